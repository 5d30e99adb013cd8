"""GGUF metadata read fast: the engine's reader against gguf-py's on every value type, and the converted GGUF
tokenizer saved once and read back the same."""

from __future__ import annotations

import os
import shutil
import struct

import gguf
import numpy as np
import pytest

from engine.model.gguf_reader import FastGGUFReader
from engine.model.tokenizer import gguf_tokenizer_cache_folder, load_gguf_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces\n\ttabs and trailing  ",
    "émoji 🦀 ünïcödé 中文",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2",
    "",
]


def assert_readers_agree(path) -> None:
    expected, actual = gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(actual.fields) == list(expected.fields)
    for key, field in expected.fields.items():
        want, got = field.contents(), actual.fields[key].contents()
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
            if want:
                assert actual.fields[key].contents(len(want) - 1) == field.contents(len(want) - 1), key
        assert list(actual.fields[key].types) == list(field.types), key
    assert (actual.alignment, actual.data_offset) == (expected.alignment, expected.data_offset)
    assert len(actual.tensors) == len(expected.tensors)
    for want, got in zip(expected.tensors, actual.tensors):
        assert (got.name, got.tensor_type, got.n_elements, got.n_bytes, got.data_offset) == (
            want.name,
            want.tensor_type,
            want.n_elements,
            want.n_bytes,
            want.data_offset,
        )
        assert np.array_equal(got.shape, want.shape)
        assert got.data.dtype == want.data.dtype and np.array_equal(got.data, want.data)


def test_every_metadata_type_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -5)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "ünïcödé 🦀")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ñ", "🦀" * 40, " spaced "])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 3.1])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])  # an array of arrays: gguf-py's own parsing
    writer.add_key_value("t.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    writer.add_key_value("t.u64s", [0, 2**64 - 1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    writer.add_key_value("t.f64s", [1e-300, -2.5], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    writer.add_key_value("t.i16s", [-1, 7], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT16)
    writer.add_tensor("w.f32", np.arange(96, dtype=np.float32).reshape(3, 32))
    values = np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64)
    q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w.q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_readers_agree(path)
    assert FastGGUFReader(path).fields["t.strings"].contents() == ["a", "", "ñ", "🦀" * 40, " spaced "]


def test_empty_arrays_read_as_gguf_py_reads_them(tmp_path):
    """gguf-py's writer refuses empty arrays, but the format allows them (a length of 0): written by hand here."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    array, int32, string_type = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, gguf.GGUFValueType.STRING
    path = tmp_path / "empty.gguf"
    path.write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 3)  # version, tensors, metadata pairs
        + string("e.ints")
        + struct.pack("<IIQ", array, int32, 0)
        + string("e.strings")
        + struct.pack("<IIQ", array, string_type, 0)
        + string("e.after")
        + struct.pack("<I", string_type)
        + string("still read")
    )
    assert_readers_agree(path)
    assert FastGGUFReader(path).fields["e.after"].contents() == "still read"


@pytest.mark.slow  # the real SmolLM2 file: gguf-py takes seconds over its vocabulary
def test_the_default_models_file_reads_as_gguf_py_reads_it(smollm2_gguf):
    assert_readers_agree(smollm2_gguf)


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "engine" / "tokenizers"


def test_a_gguf_tokenizer_is_converted_once_and_read_back_the_same(smollm2_gguf, tokenizer_cache, monkeypatch):
    from transformers import AutoTokenizer

    direct = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    first = load_gguf_tokenizer(smollm2_gguf)
    folder = gguf_tokenizer_cache_folder(smollm2_gguf)
    assert os.path.dirname(folder) == str(tokenizer_cache) and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    assert [p for p in os.listdir(tokenizer_cache) if p.startswith(".")] == []  # no staging folder left behind

    sources = []
    from_pretrained = AutoTokenizer.from_pretrained.__func__  # type: ignore[attr-defined]

    def recorded(cls, path, *args, **kwargs):
        sources.append((str(path), kwargs.get("gguf_file")))
        return from_pretrained(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recorded))
    cached = load_gguf_tokenizer(smollm2_gguf)
    assert sources == [(folder, None)]  # the second load reads the saved folder, not the GGUF file
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for tokenizer in (first, cached):
        assert type(tokenizer) is type(direct) and tokenizer.get_vocab() == direct.get_vocab()
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "chat_template"):
            assert getattr(tokenizer, name) == getattr(direct, name), name
        for text in TEXTS:
            ids = direct.encode(text)
            assert tokenizer.encode(text) == ids, text
            assert tokenizer.decode(ids) == direct.decode(ids)
            assert tokenizer.decode(ids, skip_special_tokens=True) == direct.decode(ids, skip_special_tokens=True)
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )


def test_a_changed_file_gets_a_new_entry_and_a_damaged_one_is_converted_again(
    smollm2_gguf, tokenizer_cache, tmp_path, caplog
):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, copy)  # a copy: its modification time is the test's to change
    folder = gguf_tokenizer_cache_folder(str(copy))
    stat = os.stat(copy)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_tokenizer_cache_folder(str(copy)) != folder  # a rewritten file is a new key

    folder = gguf_tokenizer_cache_folder(str(copy))
    os.makedirs(folder)
    (tokenizer_cache / os.path.basename(folder) / "tokenizer_config.json").write_text("{ not json")
    with caplog.at_level("WARNING", logger="engine.model.tokenizer"):
        tokenizer = load_gguf_tokenizer(str(copy))
    assert "unreadable" in caplog.text
    assert tokenizer.encode("Hello world") == load_gguf_tokenizer(str(copy)).encode("Hello world")
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
