"""The torch reference attention backend over the paged KV cache (the CPU path).

Decode rows of a step (one query token each) run as one batched ``scaled_dot_product_attention``
over their gathered blocks; prompt chunks run one call each, straight on the new K/V when nothing
precedes them in the cache, else over the gathered blocks with a causal offset mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.paged_cache import write_to_paged_cache
from engine.hookspecs import hookimpl
from engine.interfaces.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class PrefillChunk:
    """Query tokens ``[q_start, q_end)`` of one request, preceded by ``context_len`` cached tokens."""

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor  # blocks covering context + chunk
    mask: Optional[torch.Tensor]  # [q_len, seq_len] bool, None: plain causal over the chunk alone


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    decode_token_indices: Optional[torch.Tensor]  # [Bd]
    decode_block_table: Optional[torch.Tensor]  # [Bd, max_blocks]
    decode_mask: Optional[torch.Tensor]  # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


def _window_mask(query_pos: torch.Tensor, key_len: int, sliding_window: Optional[int]) -> torch.Tensor:
    """[q, key_len] bool: key j visible from query position p when j <= p (and p - j < window)."""
    keys = torch.arange(key_len)
    mask = keys[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= keys[None, :] > query_pos[:, None] - sliding_window
    return mask


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        decode_rows, prefill_rows = split_decodes(common)
        decode_indices = decode_table = decode_mask = None
        if len(decode_rows):
            seq_lens = common.seq_lens_np[decode_rows]
            num_blocks = -(-int(seq_lens.max()) // self.block_size)
            decode_indices = torch.from_numpy(common.query_start_loc_np[decode_rows].astype(np.int64))
            decode_table = common.block_table[torch.from_numpy(decode_rows), :num_blocks].long()
            positions = torch.from_numpy(seq_lens.astype(np.int64) - 1)
            decode_mask = _window_mask(positions, num_blocks * self.block_size, self.sliding_window)[:, None, None, :]
        return TorchAttentionMetadata(
            common.num_actual_tokens,
            common.slot_mapping,
            decode_indices,
            decode_table,
            decode_mask,
            self.build_prefills(common, prefill_rows),
        )

    def build_prefills(self, common: CommonAttentionMetadata, rows: np.ndarray) -> list[PrefillChunk]:
        """One chunk per request with more than one query token."""
        qsl, seq_lens = common.query_start_loc_np, common.seq_lens_np
        prefills = []
        for row in rows:
            q_start, q_end, seq_len = int(qsl[row]), int(qsl[row + 1]), int(seq_lens[row])
            context_len = seq_len - (q_end - q_start)
            num_blocks = -(-seq_len // self.block_size)
            mask = None
            if context_len > 0 or self.sliding_window is not None:
                mask = _window_mask(torch.arange(context_len, seq_len), seq_len, self.sliding_window)
            prefills.append(
                PrefillChunk(q_start, q_end, context_len, common.block_table[row, :num_blocks].long(), mask)
            )
        return prefills


def split_decodes(common: CommonAttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """Rows with one query token (decodes) and rows with more (prompt chunks)."""
    is_decode = np.diff(common.query_start_loc_np) == 1
    return np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]


class TorchAttentionImpl(AttentionImpl):
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool = False
    ) -> torch.Tensor:
        """q [B, Hq, n, D], k/v [B, Hkv, L, D] -> [B, Hq, n, D]."""
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

    def forward(self, query, key, value, kv_cache, attn_metadata: TorchAttentionMetadata):
        num_tokens = attn_metadata.num_actual_tokens
        head, kv_heads = self.head_size, self.num_kv_heads
        q, k, v = self.split_heads(query, key, value, num_tokens)
        write_to_paged_cache(k, v, kv_cache, attn_metadata.slot_mapping)
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

    @staticmethod
    def get_impl_cls():
        return TorchAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TorchAttentionMetadataBuilder


@hookimpl
def engine_attention_backends():
    return [TorchAttentionBackend]
