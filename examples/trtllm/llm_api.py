"""SPIN with TensorRT-LLM's LLM API (needs tensorrt_llm and a DeepSeek-V3.2/V4 checkpoint).

    python examples/trtllm/llm_api.py --model /models/DeepSeek-V4-Flash --tp 8 --sparsity 0.4
"""

import argparse

import spin_trtllm.trtllm  # noqa: F401  (enables SPIN in TensorRT-LLM; logs what it patched)
from tensorrt_llm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--algorithm", choices=["deepseek_v4", "dsa"], default="deepseek_v4")
    ap.add_argument("--sparsity", type=float, default=0.4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(model=args.model, tensor_parallel_size=args.tp,
              sparse_attention_config={"algorithm": args.algorithm,
                                       "spin": {"target_sparsity": args.sparsity}})
    prompts = ["Summarize the plot of Hamlet in three sentences.",
               "Write a Python function that merges two sorted lists."]
    for out in llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens)):
        print(repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
