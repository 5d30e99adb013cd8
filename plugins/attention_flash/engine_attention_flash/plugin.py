"""FlashAttentionBackend: flash-attn's varlen kernel reading K/V straight from the paged cache.

flash-attn's paged mode (``block_table``) needs pages of a multiple of 256 tokens, so this backend
declares block sizes 256 and 512; it runs float16 / bfloat16 on CUDA. flash-attn is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine import hookimpl
from engine.attention.cuda_reasons import cuda_library_reasons
from engine.attention.paged_cache import write_to_paged_cache
from engine.interfaces.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

ENGINE_CONTRACT_VERSION = "1.0"


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32: cumulative context + new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_blocks] int32


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        cu_k = np.concatenate([[0], np.cumsum(common.seq_lens_np)]).astype(np.int32)
        device = self.device
        return FlashAttentionMetadata(
            common.num_actual_tokens,
            common.slot_mapping.to(device),
            common.query_start_loc.to(device),
            torch.from_numpy(cu_k).to(device),
            common.max_query_len,
            common.max_seq_len,
            common.block_table.to(device),
        )


class FlashAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        from flash_attn import flash_attn_varlen_func

        tokens = attn_metadata.num_actual_tokens
        q = query.view(tokens, self.num_heads, self.head_size)
        write_to_paged_cache(
            key.view(tokens, self.num_kv_heads, self.head_size),
            value.view(tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata.slot_mapping,
        )
        window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)
        out = flash_attn_varlen_func(
            q,
            kv_cache[0],
            kv_cache[1],
            attn_metadata.cu_seqlens_q,
            attn_metadata.cu_seqlens_k,
            attn_metadata.max_seqlen_q,
            attn_metadata.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            window_size=window,
            softcap=self.logits_soft_cap or 0.0,
            block_table=attn_metadata.block_table,
        )
        return out.reshape(tokens, self.num_heads * self.head_size)


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention-2 on CUDA (causal attention is bottom-right aligned: chunks after a prefix work)."""

    name = "flash"
    priority = 40
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = tuple(range(8, 257, 8))
    supported_block_sizes = (256, 512)
    supported_devices = ("cuda",)
    # FlashAttention's varlen kernel takes per-head K and V of one head size; MLA's decode needs a latent cache
    # of kv_lora_rank + rope dims shared by all heads, which flash-attn (2.x) has no paged kernel for
    mla_unsupported_reason = "flash-attn has no paged kernel over a shared latent cache (use cpu, triton or torch)"

    @classmethod
    def library_reasons(cls) -> list[str]:
        return cuda_library_reasons("flash_attn", "pip install 'engine-attention-flash[flash]'")

    @staticmethod
    def get_impl_cls():
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return FlashAttentionMetadataBuilder


@hookimpl
def engine_attention_backends():
    return [FlashAttentionBackend]
