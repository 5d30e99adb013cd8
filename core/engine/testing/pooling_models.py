"""Tiny random pooling models written by transformers: BERT / XLM-RoBERTa encoders and cross-encoders (with a small
WordPiece vocabulary), decoder embedders saved as the bare model, and sentence-transformers folders around them."""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path
from typing import Optional

import torch

ENCODER_SETTINGS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    type_vocab_size=2,
)
_WORDS = (
    "the a of and to in is was for on that with as by it be are from at this an which or not have had one were all "
    "their has been more when there can who its no time only so would other into some could first also new after "
    "query document passage answer question search engine model text cat dog fish bird tree river mountain city"
).split()


def wordpiece_tokenizer_folder(out_dir: str | Path) -> str:
    """A lower-casing WordPiece tokenizer (BERT's special tokens, letters, digits, punctuation, common words)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer_config.json").exists():
        chars = list(string.ascii_lowercase + string.digits + string.punctuation)
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars), *_WORDS]
        (out / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
        backend = BertWordPieceTokenizer(str(out / "vocab.txt"), lowercase=True)
        specials = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
        PreTrainedTokenizerFast(
            tokenizer_object=backend._tokenizer,
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
            **specials,
        ).save_pretrained(out)
    return str(out)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)


def write_sentence_transformers_config(
    folder: str | Path, pooling: str, normalize: bool, dimension: int, max_seq_length: int
) -> None:
    """modules.json (Transformer, Pooling[, Normalize]) and the Pooling module's config, as sentence-transformers
    saves them: the folder then loads in sentence-transformers too (and in vLLM, which reads ``max_seq_length``)."""
    folder = Path(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    config = {"word_embedding_dimension": dimension, **{key: name == pooling for name, key in modes.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    config_path = folder / "sentence_bert_config.json"
    config_path.write_text(json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))


def make_tiny_encoder(
    out_dir: str | Path,
    config_cls_name: str = "BertConfig",
    model_cls_name: str = "BertModel",
    seed: int = 0,
    sentence_transformers: Optional[str] = None,
    normalize: bool = True,
    **overrides,
) -> str:
    """A random BERT-like encoder (``BertModel``, ``BertForSequenceClassification``, ``XLMRobertaModel``...) with the
    WordPiece tokenizer; ``sentence_transformers``: also a sentence-transformers pipeline pooling by ``cls`` /
    ``mean`` / ``last`` (normalised when ``normalize``)."""
    import transformers

    out = Path(out_dir)
    tokenizer_dir = wordpiece_tokenizer_folder(out.parent / "wordpiece")
    vocab_size = len(Path(tokenizer_dir, "vocab.txt").read_text().split())
    settings = {**ENCODER_SETTINGS, "vocab_size": vocab_size, **overrides}
    if "Roberta" in config_cls_name:
        settings.setdefault("pad_token_id", 0)  # the WordPiece vocabulary's [PAD]
        settings["max_position_embeddings"] = settings["max_position_embeddings"] + settings["pad_token_id"] + 1
        settings["type_vocab_size"] = 1
    config = getattr(transformers, config_cls_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    if sentence_transformers:
        positions = settings["max_position_embeddings"] - (
            settings["pad_token_id"] + 1 if "Roberta" in config_cls_name else 0
        )
        write_sentence_transformers_config(out, sentence_transformers, normalize, config.hidden_size, positions)
    return str(out)


def make_tiny_decoder_embedder(
    out_dir: str | Path,
    tokenizer_dir: str,
    config_cls_name: str = "Qwen3Config",
    seed: int = 0,
    sentence_transformers: Optional[str] = "last",
    **overrides,
) -> str:
    """A random decoder stack saved as the bare model (``Qwen3Model``: no LM head, no ``model.`` prefix), as decoder
    embedders ship, with SmolLM2's tokenizer; by default a sentence-transformers last-token, normalised pipeline."""
    import transformers

    from engine.testing.models import TINY_SETTINGS

    settings = {**TINY_SETTINGS, "max_position_embeddings": 512, **overrides}
    config = getattr(transformers, config_cls_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    if sentence_transformers:
        write_sentence_transformers_config(
            out, sentence_transformers, True, config.hidden_size, settings["max_position_embeddings"]
        )
    return str(out)
