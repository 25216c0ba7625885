"""Send one request to the Triton model that `spin-trtllm build` wrote (tritonclient, HTTP).

    pip install "spin-trtllm[triton]"   # or: pip install "tritonclient[http]"
    python examples/trtllm/client.py --url localhost:8000 --model spin_llm "Hello"
"""

import argparse

import numpy as np
import tritonclient.http as http


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--url", default="localhost:8000")
    ap.add_argument("--model", default="spin_llm")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = http.InferenceServerClient(args.url)
    text = http.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([args.prompt.encode()], dtype=object))
    max_tokens = http.InferInput("sampling_param_max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([args.max_tokens], dtype=np.int32))
    result = client.infer(args.model, [text, max_tokens],
                          outputs=[http.InferRequestedOutput("text_output")])
    print(result.as_numpy("text_output")[0].decode())


if __name__ == "__main__":
    main()
