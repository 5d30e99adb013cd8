"""TritonAttentionBackend: paged attention in Triton kernels.

On CUDA the kernels compile; on the CPU they run under the Triton interpreter (``TRITON_INTERPRET=1``,
set by this plugin for CPU devices): exact but slow, for testing. ``auto`` picks it only on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from engine import hookimpl
from engine.attention.mla import MLACommonImpl
from engine.attention.torch_metadata import TorchAttentionMetadata, TorchAttentionMetadataBuilder
from engine.interfaces.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

ENGINE_CONTRACT_VERSION = "1.0"


def _kernels(device: torch.device):
    """Import the kernels, switching on the interpreter first when they must run on the CPU."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from engine_attention_triton import kernels

    return kernels


def _imported_without_interpreter() -> bool:
    """Triton's own library functions (tl.sum, tl.max...) are bound to interpreter mode when triton is
    first imported; if that happened without TRITON_INTERPRET=1, CPU launches would fail mid-kernel."""
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.sum).__name__ != "InterpretedFunction"


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    token_request: torch.Tensor  # [T] int32: row of each query token's request
    token_position: torch.Tensor  # [T] int32: position of each query token
    common: CommonAttentionMetadata
    options: dict[str, Any]
    mla_split: Optional[TorchAttentionMetadata] = None  # decode rows and prompt chunks, made by the first MLA layer


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        query_lens = np.diff(common.query_start_loc_np)
        token_request = np.repeat(np.arange(common.num_reqs, dtype=np.int32), query_lens)
        token_position = (
            np.arange(common.num_actual_tokens)
            - np.repeat(common.query_start_loc_np[:-1], query_lens)
            + np.repeat(common.num_computed_tokens_np, query_lens)
        ).astype(np.int32)
        to = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
        return TritonAttentionMetadata(
            common.num_actual_tokens,
            common.slot_mapping.to(self.device),
            common.block_table.to(self.device),
            to(token_request),
            to(token_position),
            common,
            self.options,
        )


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = None

    def forward(self, query, key, value, kv_cache, attn_metadata: TritonAttentionMetadata):
        if self.kernels is None:
            self.kernels = _kernels(query.device)
        import triton

        tokens = attn_metadata.num_actual_tokens
        head, kv_heads = self.head_size, self.num_kv_heads
        q = query.view(tokens, self.num_heads, head)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, Hkv, D]
        # a narrower cache (cache.kv_cache_dtype) gets rows rounded by torch, to nearest even on every device (the
        # interpreter's bfloat16 store truncates)
        k = key.view(tokens, kv_heads, head).to(key_cache.dtype)
        v = value.view(tokens, kv_heads, head).to(value_cache.dtype)
        block_d = triton.next_power_of_2(head)
        block_size = key_cache.shape[1]
        self.kernels.reshape_and_cache_kernel[(tokens, kv_heads)](
            k,
            v,
            key_cache,
            value_cache,
            attn_metadata.slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            BLOCK_SIZE=block_size,
            HEAD_DIM=head,
            BLOCK_D=block_d,
        )
        output = torch.empty_like(q)
        self.kernels.paged_attention_kernel[(tokens, self.num_heads)](
            output,
            q,
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.token_request,
            attn_metadata.token_position,
            self.scale,
            float(self.logits_soft_cap or 0.0),
            int(self.sliding_window or 0),
            q.stride(0),
            q.stride(1),
            output.stride(0),
            output.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            attn_metadata.block_table.stride(0),
            QUERIES_PER_KV=self.num_heads // kv_heads,
            BLOCK_SIZE=block_size,
            HEAD_DIM=head,
            BLOCK_D=block_d,
            USE_SOFT_CAP=self.logits_soft_cap is not None,
            USE_WINDOW=self.sliding_window is not None,
        )
        return output.view(tokens, self.num_heads * head)


class TritonMLAImpl(MLACommonImpl):
    """MLA in Triton: decode tokens in the absorbed form through the paged attention kernel (the latent cache as one
    KV head serving as keys and, its first ``kv_lora_rank`` columns, values); prompt chunks expanded through SDPA."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = None

    def forward(self, query, kv_c_normed, k_pe, kv_cache, attn_metadata: TritonAttentionMetadata):
        if self.kernels is None:
            self.kernels = _kernels(query.device)
        import triton

        if attn_metadata.mla_split is None:  # once per step, shared by every MLA layer
            builder = TorchAttentionMetadataBuilder(attn_metadata.options, query.device, kv_cache.shape[1])
            attn_metadata.mla_split = builder.build(attn_metadata.common)
        split = attn_metadata.mla_split
        latents = torch.cat([kv_c_normed, k_pe], dim=-1)
        self.write_latents(latents, kv_cache, attn_metadata.slot_mapping)
        output = query.new_empty(attn_metadata.num_actual_tokens, self.num_heads * self.v_head_dim)
        idx = split.decode_token_indices
        if idx is not None:
            q_latent = self.absorbed_queries(query[idx]).contiguous()  # [Bd, H, L + rope]
            cache = kv_cache.unsqueeze(2)  # [blocks, block_size, 1, L + rope]
            latent_out = torch.empty_like(q_latent)
            head = self.latent_size
            self.kernels.paged_attention_kernel[(len(idx), self.num_heads)](
                latent_out,
                q_latent,
                cache,
                cache,
                attn_metadata.block_table,
                attn_metadata.token_request[idx.to(query.device)],
                attn_metadata.token_position[idx.to(query.device)],
                self.scale,
                0.0,
                0,
                q_latent.stride(0),
                q_latent.stride(1),
                latent_out.stride(0),
                latent_out.stride(1),
                cache.stride(0),
                cache.stride(1),
                cache.stride(2),
                attn_metadata.block_table.stride(0),
                QUERIES_PER_KV=self.num_heads,
                BLOCK_SIZE=cache.shape[1],
                HEAD_DIM=head,
                BLOCK_D=triton.next_power_of_2(head),
                USE_SOFT_CAP=False,
                USE_WINDOW=False,
            )
            output[idx] = self.values_from_latents(latent_out[..., : self.kv_lora_rank])
        self.attend_prefills(query, latents, kv_cache, split.prefills, output)
        return output


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: CUDA, or the CPU through the interpreter."""

    name = "triton"
    priority = 20
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = (torch.bfloat16, torch.float16)  # rows rounded by torch, loads widen to float32
    supported_block_sizes = (8, 16, 32, 64, 128)

    @classmethod
    def library_reasons(cls) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed (pip install 'engine-attention-triton[triton]')"]
        return []

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        reasons = super().unavailable_reasons(ctx)
        if not reasons and ctx.device == "cpu" and _imported_without_interpreter():
            reasons.append(
                "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
                "on the CPU in this process; export TRITON_INTERPRET=1 before starting Python"
            )
        return reasons

    @classmethod
    def preferred_for(cls, ctx) -> bool:
        return ctx.device == "cuda"  # on the CPU the interpreter is for testing, never the default

    @staticmethod
    def get_impl_cls():
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_mla_impl_cls():
        return TritonMLAImpl


@hookimpl
def engine_attention_backends():
    return [TritonAttentionBackend]
