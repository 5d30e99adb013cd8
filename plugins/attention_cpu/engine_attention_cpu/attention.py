"""The ``cpu`` attention backend: decode tokens through a C++ kernel that reads the paged KV cache in
place (no gathered copy, no padding to the longest request); prompt chunks through a second kernel over the same
cache (register tiles, a running softmax), or torch's SDPA for head sizes that are not a multiple of 16 (and where
``attention.options`` says ``{"prefill": "sdpa"}``, for A/B comparisons).

The kernel (``csrc/paged_attention.cpp``) is compiled when this distribution is installed
(``pip install --no-build-isolation plugins/attention_cpu``); without it the backend reports itself
unavailable and ``auto`` falls back to ``torch``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from engine.attention.mla import MLACommonImpl
from engine.attention.torch_backend import PrefillChunk, TorchAttentionImpl, TorchAttentionMetadataBuilder
from engine.config import ConfigError
from engine.interfaces.attention import AttentionBackend, CommonAttentionMetadata


@dataclass
class CpuAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    decode_token_indices: Optional[torch.Tensor]  # [Bd] int64; None when the step has no decode token
    decode_block_table: Optional[torch.Tensor]  # [Bd, max_blocks] int32, contiguous
    decode_seq_lens: Optional[torch.Tensor]  # [Bd] int32
    all_decode: bool  # every token of the step is a decode token (no gather / scatter needed)
    prefills: list[PrefillChunk]


# attention.options.prefill: prompt chunks through the kernel (where it takes the head size) or through torch's SDPA
PREFILL_CHOICES = ("kernel", "sdpa")

# a request continuing its context with at most this many query tokens (speculative decoding's verification of
# drafts) attends through the paged decode kernel, one decode row per token, each seeing its causal prefix
MAX_DECODE_LIKE_QUERY = 16


def split_decode_like(common: CommonAttentionMetadata, every_row: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Rows with one query token or a few past a computed context (decode kernel), and the other rows;
    ``every_row`` (batch-invariant): every row attends through the decode kernel, one decode row per query token, so
    a token's attention is the same sums whether it is decoded, verified or part of a prompt chunk of any size."""
    query_lens = np.diff(common.query_start_loc_np)
    if every_row:
        return np.arange(len(query_lens)), np.arange(0)
    decode_like = (query_lens == 1) | ((query_lens <= MAX_DECODE_LIKE_QUERY) & (common.num_computed_tokens_np > 0))
    return np.nonzero(decode_like)[0], np.nonzero(~decode_like)[0]


def _as_contiguous(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a contiguous ``dtype`` tensor: itself where it already is one (no dispatch, each step)."""
    return tensor if tensor.dtype == dtype and tensor.is_contiguous() else tensor.to(dtype).contiguous()


class CpuAttentionMetadataBuilder(TorchAttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:  # type: ignore[override]  # its own
        if common.max_query_len == 1:  # a pure decode step: every row one token, a decode row (batch-invariant too)
            return CpuAttentionMetadata(
                len(common.seq_lens_np),
                _as_contiguous(common.slot_mapping, torch.int64),
                torch.from_numpy(common.query_start_loc_np[:-1].astype(np.int64)),
                _as_contiguous(common.block_table, torch.int32),
                _as_contiguous(common.seq_lens, torch.int32),
                True,
                [],
            )
        decode_rows, prefill_rows = split_decode_like(common, self.batch_invariant)
        indices = table = lens = None
        all_decode = len(prefill_rows) == 0
        if len(decode_rows):
            query_lens = np.diff(common.query_start_loc_np)[decode_rows]
            if (query_lens == 1).all():
                if all_decode:
                    table, lens = common.block_table, common.seq_lens
                else:
                    rows = torch.from_numpy(decode_rows)
                    table, lens = common.block_table[rows].contiguous(), common.seq_lens[rows].contiguous()
                indices = torch.from_numpy(common.query_start_loc_np[decode_rows].astype(np.int64))
            else:  # one decode row per query token: token j of a row sees the context and the row's tokens up to j
                starts = common.query_start_loc_np[decode_rows]
                offsets = np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
                token_lens = np.repeat(common.seq_lens_np[decode_rows] - query_lens, query_lens) + offsets + 1
                table = common.block_table[torch.from_numpy(np.repeat(decode_rows, query_lens))]
                lens = torch.from_numpy(token_lens.astype(np.int32))
                indices = torch.from_numpy((np.repeat(starts, query_lens) + offsets).astype(np.int64))
        return CpuAttentionMetadata(
            common.num_actual_tokens,
            common.slot_mapping.to(torch.int64).contiguous(),
            indices,
            table if table is None else table.to(torch.int32).contiguous(),
            lens if lens is None else lens.to(torch.int32).contiguous(),
            all_decode,
            self.build_prefills(common, prefill_rows),
        )


class CpuAttentionImpl(TorchAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from engine_attention_cpu import _C

        self._decode = _C.paged_decode_attention
        self._write_kv = _C.write_kv_cache
        # the prefill kernel's register tiles: a build with vector variants, head sizes in 16-lane steps
        vectors = any(runs for _, runs in _C.variants())
        prefill = self.options.get("prefill", "kernel")
        if prefill not in PREFILL_CHOICES:
            raise ConfigError(
                f"attention.options.prefill: {prefill!r} is not one of {', '.join(map(repr, PREFILL_CHOICES))}"
            )
        takes = prefill == "kernel" and vectors and self.head_size % 16 == 0
        self._prefill = _C.paged_prefill_attention if takes else None

    def forward(self, query, key, value, kv_cache, attn_metadata: CpuAttentionMetadata):  # type: ignore[override]
        num_tokens = attn_metadata.num_actual_tokens
        head = self.head_size
        q, k, v = self.split_heads(query, key, value, num_tokens)
        # head-major blocks [blocks, Hkv, block_size, D], seen token-major as [blocks, block_size, Hkv, D]
        key_cache, value_cache = kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
        self._write_kv(key_cache, value_cache, k, v, attn_metadata.slot_mapping)
        output = torch.empty(num_tokens, self.num_heads, head, dtype=query.dtype)
        if attn_metadata.decode_token_indices is not None:
            soft_cap = float(self.logits_soft_cap or 0.0)
            window = int(self.sliding_window or 0)
            if attn_metadata.all_decode:
                self._decode(
                    output,
                    q.contiguous(),
                    key_cache,
                    value_cache,
                    attn_metadata.decode_block_table,
                    attn_metadata.decode_seq_lens,
                    self.scale,
                    soft_cap,
                    window,
                )
            else:
                idx = attn_metadata.decode_token_indices
                decoded = torch.empty(len(idx), self.num_heads, head, dtype=query.dtype)
                self._decode(
                    decoded,
                    q[idx],
                    key_cache,
                    value_cache,
                    attn_metadata.decode_block_table,
                    attn_metadata.decode_seq_lens,
                    self.scale,
                    soft_cap,
                    window,
                )
                output[idx] = decoded
        if self._prefill is None:  # head sizes the tiles do not take, builds without vector variants, prefill=sdpa
            k, v = self.as_cached(k, v, kv_cache)
            self.attend_prefills(q, k, v, kv_cache[0], kv_cache[1], attn_metadata.prefills, output)
            return output.view(num_tokens, self.num_heads * head)
        for chunk in attn_metadata.prefills:
            self._prefill(
                output[chunk.q_start : chunk.q_end],
                q[chunk.q_start : chunk.q_end],
                key_cache,
                value_cache,
                chunk.block_ids,
                chunk.context_len,
                self.scale,
                float(self.logits_soft_cap or 0.0),
                int(self.sliding_window or 0),
            )
        return output.view(num_tokens, self.num_heads * head)

    def gather_context(self, cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        """cache [blocks, Hkv, block_size, D] -> [Hkv, seq_len, D]."""
        return cache[block_ids].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_size)[:, :seq_len]


class CpuMLAImpl(MLACommonImpl):
    """MLA on the CPU: decode rows in the absorbed form through ``csrc/mla_decode.cpp`` (every query head of a request
    over the same latent rows, read in place: two small GEMMs per request, the rows walked once per pass whatever the
    head count); prompt chunks expanded through torch's SDPA."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from engine_attention_cpu import _mla

        self._decode = _mla.mla_decode_attention

    def forward(self, query, kv_c_normed, k_pe, kv_cache, attn_metadata: CpuAttentionMetadata):
        num_tokens = attn_metadata.num_actual_tokens
        latents = torch.cat([kv_c_normed, k_pe], dim=-1)
        self.write_latents(latents, kv_cache, attn_metadata.slot_mapping)
        output = query.new_empty(num_tokens, self.num_heads * self.v_head_dim)
        idx = attn_metadata.decode_token_indices
        if idx is not None:
            rows = query if attn_metadata.all_decode else query[idx]
            q_latent = self.absorbed_queries(rows).contiguous()
            latent_out = q_latent.new_empty(len(idx), self.num_heads, self.kv_lora_rank)
            self._decode(
                latent_out,
                q_latent,
                kv_cache,
                attn_metadata.decode_block_table,
                attn_metadata.decode_seq_lens,
                self.scale,
            )
            if attn_metadata.all_decode:
                return self.values_from_latents(latent_out)
            output[idx] = self.values_from_latents(latent_out)
        self.attend_prefills(query, latents, kv_cache, attn_metadata.prefills, output)
        return output


class CpuAttentionBackend(AttentionBackend):
    """Paged attention for CPUs; ``auto`` prefers it over ``torch`` whenever its kernel is built."""

    name = "cpu"
    priority = 10
    supported_devices = ("cpu",)
    supported_kv_cache_dtypes = (torch.bfloat16, torch.float16)  # the kernels read 16-bit rows under float32 queries
    batch_invariant_unsupported_reason = None  # every token through the decode kernel: one pass per (row, KV head)
    supports_encoder_only = True  # TorchAttentionImpl's: SDPA over each run of equal-length prompts

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """K and V with each (block, KV head) contiguous: a decode walks one head's rows without strides."""
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @classmethod
    def library_reasons(cls) -> list[str]:
        if any(importlib.util.find_spec(f"engine_attention_cpu.{name}") is None for name in ("_C", "_mla")):
            return ["its C++ kernels are not built (pip install --no-build-isolation plugins/attention_cpu)"]
        return []

    @staticmethod
    def get_impl_cls():
        return CpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return CpuAttentionMetadataBuilder

    @staticmethod
    def get_mla_impl_cls():
        return CpuMLAImpl
