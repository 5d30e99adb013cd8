"""Embed a corpus with sentence-transformers (its defaults: batches of 32, sorted by length), timed after a warm-up.

usage: python embed_sentence_transformers.py MODEL_DIR PASSAGES_JSON [float32|bfloat16] [batch=32]
Prints one JSON line. Runs in its own default environment (nothing of the engine's).
"""

import json
import sys
import time

import torch
from sentence_transformers import SentenceTransformer


def main() -> None:
    model_dir, passages_path = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    with open(passages_path) as f:
        passages = json.load(f)
    model = SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    model.max_seq_length = model.tokenizer.model_max_length = 100_000  # no truncation: the engine embeds it all
    model.encode(passages[:8], batch_size=batch)
    start = time.perf_counter()
    model.encode(passages, batch_size=batch)
    seconds = time.perf_counter() - start
    print(json.dumps({"engine": "sentence-transformers", "dtype": dtype, "batch": batch, "seconds": round(seconds, 3)}))


if __name__ == "__main__":
    main()
