"""Fixtures: tiny random models written by transformers, the default SmolLM2 GGUF, references."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton binds its library functions to interpreter mode at import: set it before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from engine.model.model_info import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, smollm2_gguf) -> str:
    """SmolLM2's tokenizer as a Hugging Face folder, shared by the tiny models."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: a random tiny model of a transformers config class, saved as a HF folder."""
    cache: dict = {}

    def make(config_cls_name: str = "LlamaConfig", max_shard_size: str | None = None, seed: int = 0, **overrides):
        import transformers

        key = (config_cls_name, max_shard_size, seed, repr(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        settings = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
        settings.update(overrides)
        config = getattr(transformers, config_cls_name)(**settings)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # random weights large enough that tokens differ across positions
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0, 0.2)
        out = tmp_path_factory.mktemp(config_cls_name.lower())
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **kwargs)
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
        cache[key] = str(out)
        return str(out)

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_tiny_model) -> str:
    return make_tiny_model()


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
