"""The torch backend's attention metadata: decode rows batched over their gathered blocks, prompt chunks one
by one with their causal (and sliding-window) masks. The ``cpu`` backend and every MLA implementation reuse it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from engine.interfaces.attention import AttentionMetadataBuilder, CommonAttentionMetadata


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
