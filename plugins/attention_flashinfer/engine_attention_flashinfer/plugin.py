"""FlashInferBackend: FlashInfer's paged prefill and decode wrappers, planned once per step.

A step of decode tokens only runs the decode wrapper; any other step runs the prefill wrapper
(which also serves the decode rows in it). Plans are made by the metadata builder, once per step and
KV-cache group, and reused by every layer. flashinfer-python is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    wrapper: Any  # a planned BatchPrefill/BatchDecodeWithPagedKVCacheWrapper
    decode_only: bool


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Builds the step's page tables; the plan itself waits for the first layer (it needs head counts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import flashinfer

        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        blocks_per_req = -(-common.seq_lens_np // self.block_size)
        indptr = np.concatenate([[0], np.cumsum(blocks_per_req)]).astype(np.int32)
        table = common.block_table.numpy()
        indices = np.concatenate([table[row, :n] for row, n in enumerate(blocks_per_req)]).astype(np.int32)
        last_page_len = (common.seq_lens_np - (blocks_per_req - 1) * self.block_size).astype(np.int32)
        to = lambda array: torch.from_numpy(array).to(self.device)
        return FlashInferMetadata(
            common.num_actual_tokens,
            common.slot_mapping.to(self.device),
            _LazyPlan(self, common, to(indptr), to(indices), to(last_page_len)),
            bool(common.max_query_len == 1),
        )


class _LazyPlan:
    """Plans on the first layer's call (when head counts and dtypes are known), then reuses the plan."""

    def __init__(self, builder, common, indptr, indices, last_page_len):
        self.builder, self.common = builder, common
        self.indptr, self.indices, self.last_page_len = indptr, indices, last_page_len
        self.planned = None

    def get(self, impl: FlashInferImpl, q_dtype, kv_dtype):
        if self.planned is not None:
            return self.planned
        b = self.builder
        window = (impl.sliding_window - 1) if impl.sliding_window else -1
        if self.common.max_query_len == 1:
            b.decode.plan(
                self.indptr,
                self.indices,
                self.last_page_len,
                impl.num_heads,
                impl.num_kv_heads,
                impl.head_size,
                b.block_size,
                pos_encoding_mode="NONE",
                window_left=window,
                logits_soft_cap=impl.logits_soft_cap,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
                sm_scale=impl.scale,
            )
            self.planned = b.decode
        else:
            b.prefill.plan(
                self.common.query_start_loc.to(b.device),
                self.indptr,
                self.indices,
                self.last_page_len,
                impl.num_heads,
                impl.num_kv_heads,
                impl.head_size,
                b.block_size,
                causal=True,
                pos_encoding_mode="NONE",
                window_left=window,
                logits_soft_cap=impl.logits_soft_cap,
                sm_scale=impl.scale,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
            self.planned = b.prefill
        return self.planned


class FlashInferImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata: FlashInferMetadata):
        tokens = attn_metadata.num_actual_tokens
        q = query.view(tokens, self.num_heads, self.head_size)
        write_to_paged_cache(
            key.view(tokens, self.num_kv_heads, self.head_size),
            value.view(tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata.slot_mapping,
        )
        wrapper = attn_metadata.wrapper.get(self, q.dtype, kv_cache.dtype)
        out = wrapper.run(q, (kv_cache[0], kv_cache[1]))
        return out.reshape(tokens, self.num_heads * self.head_size)


class FlashInferBackend(AttentionBackend):
    """FlashInfer on CUDA; the default on GPUs where it is installed."""

    name = "flashinfer"
    priority = 50
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (64, 128, 256)
    supported_block_sizes = (8, 16, 32, 64, 128, 256)
    supported_devices = ("cuda",)
    # flashinfer's own MLA wrapper (BatchMLAPagedAttentionWrapper) takes split ckv / kpe caches and is not wired
    # into this plugin yet
    mla_unsupported_reason = "this plugin does not wire flashinfer's MLA wrapper yet (use cpu, triton or torch)"

    @classmethod
    def library_reasons(cls) -> list[str]:
        return cuda_library_reasons("flashinfer", "pip install 'engine-attention-flashinfer[flashinfer]'")

    @staticmethod
    def get_impl_cls():
        return FlashInferImpl

    @staticmethod
    def get_builder_cls():
        return FlashInferMetadataBuilder


@hookimpl
def engine_attention_backends():
    return [FlashInferBackend]
