"""Multi-head latent attention (MLA) over the latent cache: the mechanics every backend shares, and the torch
reference.

A token's cache row is its normalised latent ``kv_c`` (``kv_lora_rank`` values) and its rotated ``k_pe``. Prompt
chunks run in the expanded form: the latents of the chunk and its context are expanded by ``kv_b_proj`` into
per-head keys (``k_nope`` + the shared ``k_pe``) and values, then ordinary causal attention. Decode tokens run in
the absorbed form: the query's nope part is projected into the latent space (``q_nope @ W_UK``), so that it attends
over the cached latents directly (one "KV head" of ``kv_lora_rank + rope`` dims shared by every query head), and the
latent output is projected back by ``W_UV``. Both forms compute the same scores: ``q_nope . (W_UK kv_c) =
(q_nope W_UK) . kv_c``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.torch_metadata import PrefillChunk, TorchAttentionMetadata
from engine.interfaces.attention import MLAAttentionImpl


class MLACommonImpl(MLAAttentionImpl):
    """The absorbed weights, the cache write and the expanded prefill; backends supply the decode over latents."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.latent_size = self.kv_lora_rank + self.qk_rope_head_dim
        self._weights: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``kv_b_proj`` [H * (nope + v), L], ``W_UK`` [H, nope, L], ``W_UV`` transposed [H, L, v]) in the
        activations' dtype (a CPU without 16-bit products keeps the model's linear weights in float32), made once."""
        if dtype not in self._weights:
            heads, nope, v_dim, rank = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
            kv_b = self.kv_b_weight.to(dtype)
            split = kv_b.view(heads, nope + v_dim, rank)
            self._weights[dtype] = (kv_b, split[:, :nope].contiguous(), split[:, nope:].transpose(1, 2).contiguous())
        return self._weights[dtype]

    def write_latents(self, latents: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """latents [T, L + rope] into the cache rows at ``slot_mapping`` [T]."""
        kv_cache.view(-1, self.latent_size).index_copy_(0, slot_mapping, latents)

    def absorbed_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [N, H, nope + rope] -> [N, H, L + rope]: the nope part through ``W_UK``, the rope part as it is."""
        nope = self.qk_nope_head_dim
        q_latent = torch.bmm(query[..., :nope].transpose(0, 1), self.weights(query.dtype)[1]).transpose(0, 1)
        return torch.cat([q_latent, query[..., nope:]], dim=-1)

    def values_from_latents(self, latent_out: torch.Tensor) -> torch.Tensor:
        """latent outputs [N, H, L] -> [N, H * v] through ``W_UV``."""
        out = torch.bmm(latent_out.transpose(0, 1), self.weights(latent_out.dtype)[2]).transpose(0, 1)
        return out.reshape(latent_out.shape[0], self.num_heads * self.v_head_dim)

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [S, L + rope] -> keys [S, H, nope + rope] and values [S, H, v]."""
        tokens, rank, nope = latents.shape[0], self.kv_lora_rank, self.qk_nope_head_dim
        kv_b = self.weights(latents.dtype)[0]
        kv = F.linear(latents[:, :rank], kv_b).view(tokens, self.num_heads, nope + self.v_head_dim)
        k_pe = latents[:, None, rank:].expand(tokens, self.num_heads, self.qk_rope_head_dim)
        return torch.cat([kv[..., :nope], k_pe], dim=-1), kv[..., nope:]

    def gather_latents(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One request's first ``seq_len`` latent rows [seq_len, L + rope] from its blocks."""
        return kv_cache[block_ids].view(-1, self.latent_size)[:seq_len]

    def attend_prefills(
        self,
        query: torch.Tensor,
        latents: torch.Tensor,
        kv_cache: torch.Tensor,
        prefills: list[PrefillChunk],
        output: torch.Tensor,
    ) -> None:
        """Each prompt chunk in the expanded form: its own latents, or its context's gathered from the cache."""
        for chunk in prefills:
            q_len = chunk.q_end - chunk.q_start
            if chunk.context_len == 0:
                chunk_latents = latents[chunk.q_start : chunk.q_end]
            else:
                chunk_latents = self.gather_latents(kv_cache, chunk.block_ids, chunk.context_len + q_len)
            keys, values = self.expand(chunk_latents)
            out = F.scaled_dot_product_attention(
                query[chunk.q_start : chunk.q_end].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=self.scale,
            )
            output[chunk.q_start : chunk.q_end] = out.transpose(0, 1).reshape(q_len, -1)


class TorchMLAImpl(MLACommonImpl):
    """The reference: decode rows attend over their gathered latent blocks in one batched SDPA call."""

    def forward(
        self,
        query: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_actual_tokens
        latents = torch.cat([kv_c_normed, k_pe], dim=-1)
        self.write_latents(latents, kv_cache, attn_metadata.slot_mapping)
        output = query.new_empty(num_tokens, self.num_heads * self.v_head_dim)
        if attn_metadata.decode_token_indices is not None:
            idx, table = attn_metadata.decode_token_indices, attn_metadata.decode_block_table
            assert table is not None
            cache = kv_cache[table].view(len(idx), 1, -1, self.latent_size)  # one latent "head" shared by all
            latent_out = F.scaled_dot_product_attention(
                self.absorbed_queries(query[idx]).unsqueeze(2),
                cache,
                cache[..., : self.kv_lora_rank],
                attn_mask=attn_metadata.decode_mask,
                scale=self.scale,
                enable_gqa=True,
            ).squeeze(2)
            output[idx] = self.values_from_latents(latent_out)
        self.attend_prefills(query, latents, kv_cache, attn_metadata.prefills, output)
        return output
