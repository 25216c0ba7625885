"""Send one request to the Triton model that `spin-trtllm build` wrote (tritonclient, gRPC).

    pip install "spin-trtllm[triton]"   # tritonclient[grpc]
    python examples/trtllm/client.py --url localhost:8001 --model spin_llm "Hello"

tritonserver listens for gRPC on port 8001 (HTTP, 8000, would need tritonclient[http]).
"""

import argparse

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--url", default="localhost:8001", help="tritonserver's gRPC address "
                                                            "(default: localhost:8001)")
    ap.add_argument("--model", default="spin_llm", help="Triton model name, build's --name "
                                                        "(default: spin_llm)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="tokens to generate (default: 64)")
    args = ap.parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([args.prompt.encode()], dtype=object))
    max_tokens = grpcclient.InferInput("sampling_param_max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([args.max_tokens], dtype=np.int32))
    result = client.infer(args.model, [text, max_tokens],
                          outputs=[grpcclient.InferRequestedOutput("text_output")])
    print(result.as_numpy("text_output")[0].decode())


if __name__ == "__main__":
    main()
