"""Triton kernels: write K/V into the paged cache, and paged attention for any mix of prefill
chunks (with cached prefixes) and decode tokens, causal, with GQA, sliding window and soft-capping.

One attention program handles one (query token, query head): it walks the token's request's block
table up to the token's own position with an online softmax. Import this module only after
``TRITON_INTERPRET`` is settled (the plugin sets it on CPU devices).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_b,
    stride_c_s,
    stride_c_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    k = tl.load(key_ptr + token * stride_k_t + head * stride_k_h + d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + head * stride_v_h + d, mask=mask)
    dst = block * stride_c_b + offset * stride_c_s + head * stride_c_h + d
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    token_request_ptr,
    token_position_ptr,
    scale,
    soft_cap,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_b,
    stride_c_s,
    stride_c_h,
    stride_bt_r,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    request = tl.load(token_request_ptr + token)
    position = tl.load(token_position_ptr + token)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_q_t + head * stride_q_h + d, mask=d_mask, other=0.0).to(tl.float32)

    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(position - sliding_window + 1, 0)
    m_i = tl.zeros([1], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for logical_block in range(first_key // BLOCK_SIZE, position // BLOCK_SIZE + 1):
        physical_block = tl.load(block_table_ptr + request * stride_bt_r + logical_block).to(tl.int64)
        key_positions = logical_block * BLOCK_SIZE + offsets
        base = physical_block * stride_c_b + offsets[:, None] * stride_c_s + kv_head * stride_c_h + d[None, :]
        k = tl.load(key_cache_ptr + base, mask=d_mask[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if USE_SOFT_CAP:
            scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)  # soft_cap * tanh(x / soft_cap)
        valid = (key_positions <= position) & (key_positions >= first_key)
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(value_cache_ptr + base, mask=d_mask[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
