"""The memory-bandwidth bound of single-stream decoding: each decode token reads every weight its products use once,
so ``read bandwidth / bytes read per token`` is the most tokens/s any engine can decode one stream at.

- ``measure_bandwidth``: STREAM-like kernels on the calling process's torch threads (the engine's own, in the
  engine's process): a read-only sum and the triad ``a = b + s * c``, over arrays far larger than the caches, best of
  several passes (GB/s, 1e9 bytes; the triad counts its three arrays' bytes, as STREAM does). The arrays are read
  twice: in torch's ordinary 4 KiB pages and in 2 MiB transparent huge pages (where the kernel offers them), and
  each rate is the faster of the two. The engine streams its weights from huge pages (``device.huge_pages``), and
  where translation limits reading (a virtual machine's nested paging: 38 against 65 GB/s on a 2-core AMD EPYC), a
  bound from 4 KiB pages alone would credit that gain to the engine.
- ``model_bytes_per_token``: what a loaded model's products read per decode token (packed blocks where the weights
  stay quantized, the float weights otherwise; the LM head included, the embedding's one row not).
- ``gguf_bytes_per_token``: the same for a GGUF file as llama.cpp runs it (every tensor its products read).
- ``kv_shares``: the bound counted with the KV cache's bytes too (each decode token reads its context's K/V once),
  for single streams after a long context (``engine bench latency --depth``), where those bytes are no longer small.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

ARRAY_BYTES = 256 * 2**20  # each array: far past any L3 of the machines this runs on
PASSES = 5


def measure_bandwidth(array_bytes: int = ARRAY_BYTES, passes: int = PASSES) -> dict[str, Any]:
    """``{"read_gb_s", "triad_gb_s", "threads"}``: the best pass of a sum over one array and of the triad, in the
    faster of 4 KiB and 2 MiB pages; each page size's own rates as ``read_gb_s_4k_pages`` ... ``_huge_pages`` (the
    latter absent where the kernel offers no huge pages)."""
    from engine.huge_pages import huge_pages_available

    result: dict[str, Any] = {"threads": torch.get_num_threads(), "array_mib": array_bytes >> 20}
    sizes = [("4k_pages", _ordinary_array)] + ([("huge_pages", _huge_page_array)] if huge_pages_available() else [])
    for pages, allocate in sizes:
        for rate, value in _stream_rates(allocate, array_bytes // 4, passes).items():
            result[f"{rate}_{pages}"] = value
            result[rate] = max(result.get(rate, 0.0), value)
    return result


def _ordinary_array(n: int) -> torch.Tensor:
    return torch.empty(n)


def _huge_page_array(n: int) -> torch.Tensor:
    from engine.huge_pages import huge_page_bytes

    return huge_page_bytes(4 * n)[: 4 * n].view(torch.float32)


def _stream_rates(allocate, n: int, passes: int) -> dict[str, float]:
    a, b, c = allocate(n), allocate(n), allocate(n)
    a.fill_(1.0), b.fill_(2.0), c.fill_(3.0)  # written: pages mapped before timing

    def best(kernel, nbytes: int) -> float:
        kernel()
        fastest = min(_timed(kernel) for _ in range(passes))
        return round(nbytes / fastest / 1e9, 2)

    return {
        "read_gb_s": best(lambda: b.sum(), 4 * n),
        "triad_gb_s": best(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * 4 * n),
    }


def combine_readings(readings: list[dict[str, Any]]) -> dict[str, Any]:
    """One bandwidth from several ``measure_bandwidth`` readings taken through a benchmark (before, between and after
    its runs): the median of each rate, with every reading kept (``read_gb_s_readings``). A shared machine's
    bandwidth drifts by half from one minute to the next, so a single reading makes any share of it a draw."""
    if not readings:
        raise ValueError("no bandwidth reading to combine")
    combined = dict(readings[0])
    rates = [key for key in readings[0] if key.endswith("_gb_s") or "_gb_s_" in key]
    for rate in rates:
        values = [reading[rate] for reading in readings if rate in reading]
        combined[rate] = round(statistics.median(values), 2)
        combined[f"{rate}_readings"] = values
    return combined


def _timed(kernel) -> float:
    start = time.perf_counter()
    kernel()
    return time.perf_counter() - start


def model_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode token's products read: each linear layer's packed blocks (``quant_weight``) or its
    float weight, each MoE layer's experts (all of them: an upper bound), and the LM head."""
    from engine.model.layers.linear import linear_layers
    from engine.model.layers.moe import moe_layers

    def stored(packed, weight: torch.Tensor) -> int:  # what the product reads: the packed blocks, else the weight
        return packed.nbytes if packed is not None else weight.numel() * weight.element_size()

    total = sum(stored(getattr(layer, "quant_weight", None), layer.weight) for layer in linear_layers(model))
    for moe in moe_layers(model):
        total += stored(moe.quant_w13, moe.w13_weight) + stored(moe.quant_w2, moe.w2_weight)
    head = getattr(model, "lm_head", None)
    if head is not None:
        total += stored(getattr(head, "quant_weight", None), head.weight)
    return int(total)


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of a GGUF file's tensors that a decode token reads in llama.cpp: every 2-D weight but the token
    embedding (one row of it), which counts when it is also the output (tied: no ``output.weight``)."""
    from engine.model.gguf_file import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    tied = "output.weight" not in tensors
    read = [t for name, t in tensors.items() if len(t.shape) >= 2 and (name != "token_embd.weight" or tied)]
    return int(sum(int(t.n_bytes) for t in read))


def decode_shares(decode_tok_s: float, bytes_per_token: int, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The bound ``read bandwidth / bytes per token`` and the share of it a decode rate reaches."""
    bound = bandwidth["read_gb_s"] * 1e9 / bytes_per_token
    return {
        "bytes_per_token": bytes_per_token,
        "bandwidth_bound_tok_s": round(bound, 1),
        "share_of_bandwidth": round(decode_tok_s / bound, 3),
    }


# bytes per element of the KV-cache types llama-bench reports (type_k / type_v); quantized caches are not counted
LLAMA_CPP_KV_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def gguf_kv_bytes_per_position(path: str, type_k: str, type_v: str) -> int | None:
    """Bytes of K and V one context position takes in llama.cpp for a GGUF file (all layers), from its cache types;
    None for a quantized cache type."""
    if type_k not in LLAMA_CPP_KV_ELEMENT_BYTES or type_v not in LLAMA_CPP_KV_ELEMENT_BYTES:
        return None
    from engine.model.gguf_file import gguf_to_hf_config

    config = gguf_to_hf_config(path)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_layer = kv_heads * head_size * (LLAMA_CPP_KV_ELEMENT_BYTES[type_k] + LLAMA_CPP_KV_ELEMENT_BYTES[type_v])
    return int(config.num_hidden_layers * per_layer)


def kv_shares(
    decode_tok_s: float, bytes_per_token: int, kv_bytes_per_position: int, positions: float, bandwidth: dict[str, Any]
) -> dict[str, Any]:
    """The bound with the KV cache counted: a token attending ``positions`` context positions (the mean over a run)
    reads ``positions * kv_bytes_per_position`` bytes of K/V besides the weights."""
    kv_bytes = kv_bytes_per_position * positions
    bound = bandwidth["read_gb_s"] * 1e9 / (bytes_per_token + kv_bytes)
    return {
        "kv_bytes_per_position": kv_bytes_per_position,
        "kv_bytes_per_token": int(kv_bytes),
        "bandwidth_bound_with_kv_tok_s": round(bound, 1),
        "share_of_bandwidth_with_kv": round(decode_tok_s / bound, 3),
    }
