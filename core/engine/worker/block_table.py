"""BlockTable: one KV-cache group's block ids for every row of the persistent input batch."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """A [max_num_reqs, max_blocks_per_req] int32 array kept across steps: a row changes only when its
    request gains blocks, enters the batch or moves to another row."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        num = int(self.num_blocks_per_row[src])
        self.block_table[dst, :num] = self.block_table[src, :num]
        self.num_blocks_per_row[dst] = num

    def row_ids(self, row: int) -> list[int]:
        return self.block_table[row, : self.num_blocks_per_row[row]].tolist()

    def table(self, num_reqs: int) -> np.ndarray:
        """The first ``num_reqs`` rows, as wide as the longest of them (contiguous, for the kernels)."""
        width = int(self.num_blocks_per_row[:num_reqs].max()) if num_reqs else 0
        return np.ascontiguousarray(self.block_table[:num_reqs, :width])

    def slot_mapping(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The cache slot of every scheduled token (row ``token_rows[i]`` at ``positions[i]``)."""
        blocks = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size
