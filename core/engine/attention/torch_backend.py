"""The torch reference attention backend over the paged KV cache (the CPU path).

Decode rows of a step (one query token each) run as one batched ``scaled_dot_product_attention``
over their gathered blocks; prompt chunks run one call each, straight on the new K/V when nothing
precedes them in the cache, else over the gathered blocks with a causal offset mask.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.mla import TorchMLAImpl
from engine.attention.paged_cache import write_to_paged_cache
from engine.attention.torch_metadata import (
    PrefillChunk,
    TorchAttentionMetadata,
    TorchAttentionMetadataBuilder,
    split_decodes,
)
from engine.hookspecs import hookimpl
from engine.interfaces.attention import AttentionBackend, AttentionImpl, CommonAttentionMetadata

__all__ = [
    "PrefillChunk",
    "TorchAttentionBackend",
    "TorchAttentionImpl",
    "TorchAttentionMetadata",
    "TorchAttentionMetadataBuilder",
    "split_decodes",
]


class TorchAttentionImpl(AttentionImpl):
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool = False
    ) -> torch.Tensor:
        """q [B, Hq, n, D], k/v [B, Hkv, L, D] (in q's dtype or a narrower cache's) -> [B, Hq, n, D]."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=is_causal,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)

    def split_heads(self, query, key, value, num_tokens: int):
        """[T, H*D] inputs as [T, H, D] views: q with the query heads, k and v with the KV heads."""
        return (
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
        )

    @staticmethod
    def as_cached(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New K/V as the cache holds them (rounded to a narrower cache.kv_cache_dtype), so a prompt attends to the
        same keys and values as the tokens decoded after it."""
        if kv_cache.dtype == k.dtype:
            return k, v
        return k.to(kv_cache.dtype).to(k.dtype), v.to(kv_cache.dtype).to(v.dtype)

    def forward(self, query, key, value, kv_cache, attn_metadata: TorchAttentionMetadata):
        num_tokens = attn_metadata.num_actual_tokens
        head, kv_heads = self.head_size, self.num_kv_heads
        q, k, v = self.split_heads(query, key, value, num_tokens)
        # rounded once: the cache takes the narrow rows as they are, the prompt attends to them widened
        k_cached, v_cached = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        write_to_paged_cache(k_cached, v_cached, kv_cache, attn_metadata.slot_mapping)
        k, v = k_cached.to(k.dtype), v_cached.to(v.dtype)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, Hkv, D]
        output = torch.empty_like(q)

        if attn_metadata.decode_token_indices is not None:
            idx, table = attn_metadata.decode_token_indices, attn_metadata.decode_block_table
            rows = len(idx)
            kd = key_cache[table].view(rows, -1, kv_heads, head).transpose(1, 2)
            vd = value_cache[table].view(rows, -1, kv_heads, head).transpose(1, 2)
            qd = q[idx].unsqueeze(2)  # [Bd, Hq, 1, D]
            output[idx] = self._attend(qd, kd, vd, attn_metadata.decode_mask).squeeze(2)

        self.attend_prefills(q, k, v, key_cache, value_cache, attn_metadata.prefills, output)
        return output.view(num_tokens, self.num_heads * head)

    def forward_encoder_only(self, query, key, value, common: CommonAttentionMetadata) -> torch.Tensor:
        """Each request's tokens attend to all of its tokens (no mask, no cache): one SDPA call per run of requests
        of one length, stacked."""
        num_tokens = common.num_actual_tokens
        if common.num_computed_tokens_np.any():
            raise RuntimeError("encoder-only attention needs every prompt whole in its step (no chunked prefill)")
        q, k, v = self.split_heads(query, key, value, num_tokens)
        output = torch.empty_like(q)
        starts = common.query_start_loc_np
        lengths = np.diff(starts)
        for length in np.unique(lengths).tolist():
            rows = np.nonzero(lengths == length)[0]
            index = torch.from_numpy((starts[rows][:, None] + np.arange(length)[None, :]).reshape(-1))
            shape = (len(rows), length)
            qs = q[index].view(*shape, self.num_heads, self.head_size).transpose(1, 2)
            ks = k[index].view(*shape, self.num_kv_heads, self.head_size).transpose(1, 2)
            vs = v[index].view(*shape, self.num_kv_heads, self.head_size).transpose(1, 2)
            output[index] = self._attend(qs, ks, vs, None).transpose(1, 2).reshape(-1, self.num_heads, self.head_size)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def gather_context(self, cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[Hkv, seq_len, D]: one request's first ``seq_len`` keys (or values) from its blocks."""
        return cache[block_ids].view(-1, self.num_kv_heads, self.head_size)[:seq_len].transpose(0, 1)

    def attend_prefills(
        self, q, k, v, key_cache, value_cache, prefills: list[PrefillChunk], output: torch.Tensor
    ) -> None:
        """Each prompt chunk in one SDPA call: on its own K/V, or over the gathered blocks with a prefix."""
        for chunk in prefills:
            qp = q[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)
            if chunk.context_len == 0:
                kp = k[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)
                vp = v[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)
            else:
                seq_len = chunk.context_len + chunk.q_end - chunk.q_start
                kp = self.gather_context(key_cache, chunk.block_ids, seq_len).unsqueeze(0)
                vp = self.gather_context(value_cache, chunk.block_ids, seq_len).unsqueeze(0)
            out = self._attend(qp, kp, vp, chunk.mask, is_causal=chunk.mask is None)
            output[chunk.q_start : chunk.q_end] = out.squeeze(0).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    """Pure torch, any device torch runs on; the reference every other backend is held to."""

    name = "torch"
    priority = 0
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the numerics oracle
    supported_kv_cache_dtypes = (torch.bfloat16, torch.float16)
    supports_encoder_only = True

    @staticmethod
    def get_impl_cls():
        return TorchAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_mla_impl_cls():
        return TorchMLAImpl


@hookimpl
def engine_attention_backends():
    return [TorchAttentionBackend]
