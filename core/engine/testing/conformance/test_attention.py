"""An attention backend gives the float64 reference's outputs and fills the paged cache, on mixed batches
(prefills, decodes, chunks after cached prefixes) with MHA / GQA / MQA, sliding windows, soft-capping,
block sizes 16 and 32, in float32 and bfloat16. A case the backend declares unsupported is skipped."""

from __future__ import annotations

import pytest
import torch

from engine.testing.attention import check_backend, check_mla_backend, unsupported
from engine.testing.conformance.conftest import implementation


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_matches_the_reference(attention_name, block_size, heads, variant, dtype):
    backend = implementation("attention", attention_name).cls
    device = (
        "cuda" if torch.cuda.is_available() and "cuda" in getattr(backend, "supported_devices", ("cuda",)) else "cpu"
    )
    why_not = unsupported(backend, block_size, variant) or (
        None if dtype in backend.supported_dtypes else f"{backend.name} does not support {dtype}"
    )
    if why_not:
        pytest.skip(why_not)
    check_backend(backend, device, block_size, *heads, variant, dtype)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_matches_the_reference(attention_name, block_size, dtype):
    """A backend that serves MLA (``get_mla_impl_cls``) gives the expanded-form reference on a mixed batch."""
    backend = implementation("attention", attention_name).cls
    if backend.get_mla_impl_cls() is None:
        pytest.skip(f"{backend.name} does not serve MLA: {backend.mla_unsupported_reason}")
    device = (
        "cuda" if torch.cuda.is_available() and "cuda" in getattr(backend, "supported_devices", ("cuda",)) else "cpu"
    )
    if dtype not in backend.supported_dtypes:
        pytest.skip(f"{backend.name} does not support {dtype}")
    check_mla_backend(backend, device, block_size, dtype)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16-cache", "fp16-cache"])
def test_a_16_bit_cache_under_float32_queries_matches_the_reference(attention_name, cache_dtype):
    """A backend that declares a 16-bit cache under float32 models (``supported_kv_cache_dtypes``, for
    cache.kv_cache_dtype) rounds new rows into it as torch's ``.to`` does and attends over the rounded rows."""
    backend = implementation("attention", attention_name).cls
    if cache_dtype not in backend.supported_kv_cache_dtypes or torch.float32 not in backend.supported_dtypes:
        pytest.skip(f"{backend.name} keeps no {cache_dtype} cache under a float32 model")
    device = (
        "cuda" if torch.cuda.is_available() and "cuda" in getattr(backend, "supported_devices", ("cuda",)) else "cpu"
    )
    check_backend(backend, device, 16, 6, 2, "plain", torch.float32, cache_dtype=cache_dtype)
