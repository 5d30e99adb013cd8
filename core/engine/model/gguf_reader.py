"""A GGUF reader that parses the metadata's arrays in bulk.

gguf-py's ``GGUFReader`` makes a NumPy view for every element of every array in the header: a tokenizer's
vocabulary and merges (about 100,000 strings for SmolLM2) take it about 7 seconds on a 2-core machine, once for the
model's config and again in every process that loads the weights. :class:`FastGGUFReader` is that reader with the
arrays of strings and numbers read at once (``struct`` over the memory map); its ``fields`` give the same
``contents()`` and its ``tensors`` are gguf-py's own, built by gguf-py from the same offsets.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

# the scalar types an array may hold, as struct codes (little-endian: the fast path reads host-order files only)
_STRUCT_CODES = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class ArrayField:
    """A metadata array of strings or numbers, decoded once: gguf-py's ``ReaderField`` interface for what the
    engine reads (``name``, ``types``, ``contents()``); ``parts`` holds the key, the type and the array header."""

    __slots__ = ("offset", "name", "parts", "data", "types", "values")

    def __init__(self, offset: int, name: str, parts: list, types: list[GGUFValueType], values: list):
        self.offset, self.name, self.parts, self.types, self.values = offset, name, parts, types, values
        self.data = list(range(len(values)))

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        return self.values[index_or_slice]


class FastGGUFReader(GGUFReader):
    """gguf-py's reader with bulk-parsed metadata arrays (see the module's docstring)."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return super()._build_fields(offs, count)
        buffer = self.data.data  # a memoryview of the memory map, read in place
        for _ in range(count):
            orig_offs = offs
            key_len, key_data = self._get_str(offs)
            offs += int(key_len.nbytes + key_data.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            name = str(bytes(key_data), encoding="utf-8")
            if raw_type[0] == GGUFValueType.ARRAY:
                item_type = GGUFValueType(int(self._get(offs, np.uint32)[0]))
                if item_type == GGUFValueType.STRING or item_type in _STRUCT_CODES:
                    size, values = _read_array(buffer, offs + 12, item_type, int(self._get(offs + 4, np.uint64)[0]))
                    header = [key_len, key_data, raw_type, self._get(offs, np.uint32), self._get(offs + 4, np.uint64)]
                    # gguf-py takes an array's item type from its first item: an empty array has none
                    types = [GGUFValueType.ARRAY, item_type] if values else [GGUFValueType.ARRAY]
                    self._push_field(ArrayField(orig_offs, name, header, types, values), skip_sum=True)  # type: ignore[arg-type]
                    offs += 12 + size
                    continue
            # scalars, strings and arrays of arrays: gguf-py's own parsing (one view each, cheap)
            parts: list = [key_len, key_data, raw_type]
            size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_type[0])
            self._push_field(
                ReaderField(orig_offs, name, parts + field_parts, [i + len(parts) for i in field_idxs], field_types),
                skip_sum=True,
            )
            offs += size
        return offs


def _read_array(buffer: memoryview, offs: int, item_type: GGUFValueType, length: int) -> tuple[int, list]:
    """(bytes the array's elements take, the elements) of ``length`` items of ``item_type`` at ``offs``."""
    if item_type != GGUFValueType.STRING:
        code = _STRUCT_CODES[item_type]
        size = struct.calcsize(code) * length
        return size, list(struct.unpack_from(f"<{length}{code}", buffer, offs))
    start, values = offs, []
    unpack_length = struct.Struct("<Q").unpack_from
    for _ in range(length):
        (string_len,) = unpack_length(buffer, offs)
        offs += 8
        values.append(str(buffer[offs : offs + string_len], encoding="utf-8"))
        offs += string_len
    return offs - start, values
