"""PrefixSummary: a Bloom filter of the prefix-cache block hashes one engine core holds.

An engine core publishes it (through the DP coordinator) so that front ends can ask "how many leading
blocks of this prompt does rank r hold?" without the core's hash table. Block hashes are sha256 digests,
already uniform, so the filter's probe positions are simply three 32-bit words of the digest. The filter
has a fixed size per core (16 bits per KV block it could cache), so with every block cached about 1.4% of
lookups are false positives; a false positive costs a routing decision, never a wrong token.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

NUM_PROBES = 3
BITS_PER_BLOCK = 16
MIN_BITS = 1024


def summary_bits(num_blocks: int) -> int:
    """The filter size for a cache of ``num_blocks`` blocks: a power of two, at least 16 bits per block."""
    bits = MIN_BITS
    while bits < BITS_PER_BLOCK * num_blocks:
        bits *= 2
    return bits


class PrefixSummary:
    """Membership of block hashes (may answer yes wrongly, never no wrongly)."""

    def __init__(self, bits: bytes, num_bits: int):
        if num_bits & (num_bits - 1) or len(bits) * 8 != num_bits:
            raise ValueError(f"a prefix summary needs a power-of-two number of bits and {num_bits // 8} bytes")
        self.bits = bits
        self.num_bits = num_bits

    @classmethod
    def build(cls, block_hashes: Iterable[bytes], num_bits: int) -> PrefixSummary:
        digests = b"".join(h[: 4 * NUM_PROBES] for h in block_hashes)
        bits = np.zeros(num_bits // 8, dtype=np.uint8)
        if digests:
            probes = np.frombuffer(digests, dtype="<u4") & np.uint32(num_bits - 1)
            np.bitwise_or.at(bits, probes >> 3, (1 << (probes & 7)).astype(np.uint8))
        return cls(bits.tobytes(), num_bits)

    def __contains__(self, block_hash: bytes) -> bool:
        mask = self.num_bits - 1
        for probe in range(NUM_PROBES):
            position = int.from_bytes(block_hash[4 * probe : 4 * probe + 4], "little") & mask
            if not self.bits[position >> 3] & (1 << (position & 7)):
                return False
        return True

    def match_length(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained block hashes) the summary holds."""
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in self:
                return index
        return len(block_hashes)
