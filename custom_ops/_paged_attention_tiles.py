"""Triton building blocks of `dlmc::paged_attention`'s kernels: tiles, key ranges, conversions.

Used by the split kernel (`_paged_attention_kernels.py`) and the merges (key ranges, so that both
agree on which splits are live). Scores are in the log2 domain (`scale_log2` folds `log2(e)`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv_append import cache_slots


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """`a @ b` of BF16 operands with fp32 accumulation.

    DOT_FP32 (interpreter only): Triton 3.6's interpreter multiplies BF16 as raw uint16, so the
    operands are widened to fp32 first (exact: BF16 products are exact in fp32).
    """
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _to_bf16(x):
    """Cache values to BF16 (exact for E4M3; FP8 goes through fp32, supported on every arch)."""
    if x.dtype.is_fp8():
        return x.to(tl.float32).to(tl.bfloat16)
    return x.to(tl.bfloat16)


@triton.jit
def _to_dot(x, DOT_F16: tl.constexpr):
    """Cache values to the dot operand type: FP8 to FP16 directly with DOT_F16 (exact, one
    conversion per pair), else to BF16."""
    y = _to_bf16(x)
    # Static branches, not one `and`: Triton does not fold it, and it types every `return`.
    if DOT_F16:  # noqa: SIM102
        if x.dtype.is_fp8():
            y = x.to(tl.float16)
    return y


@triton.jit
def attend_tile(
    q, k, v, key_mask, scale_log2, m_i, l_i, acc, DOT_FP32: tl.constexpr
):  # q [BM, D] bf16, k/v [BN, D] bf16, key_mask [BM, BN]
    scores = _dot(q, tl.trans(k), DOT_FP32) * scale_log2  # [BM, BN] fp32, log2 domain
    scores = tl.where(key_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BM]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)  # [BM, D]
    return m_new, l_i, acc


@triton.jit
def split_range(raw_prefix, max_tokens, window, NUM_SPLITS: tl.constexpr,
                 MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, prefix, keys per split, live splits) of the visible cached range, on device."""
    prefix = tl.minimum(raw_prefix, max_tokens)
    start = tl.where(window > 0, tl.maximum(prefix - (window - 1), 0), 0)
    per_split = tl.cdiv(tl.cdiv(prefix - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, MIN_SPLIT_KEYS)
    return start, prefix, per_split, tl.cdiv(prefix - start, per_split)


@triton.jit
def row_window(key_mask, keys, row_lo, PER_QUERY: tl.constexpr):
    """`key_mask` (`[1, BN]` or `[BM, BN]`), with PER_QUERY also `keys >= row_lo` per row
    (`row_lo [BM]`: each query's first visible position, `window_per_query`)."""
    if PER_QUERY:
        key_mask = key_mask & (keys[None, :] >= row_lo[:, None])
    return key_mask


@triton.jit
def cache_tile(
    q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp, stride_cs,
    stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_F16: tl.constexpr, row_lo=0,
    PER_QUERY: tl.constexpr = False,
):
    """Attend cached keys `j .. j+BLOCK_N-1` (those below `hi`; PER_QUERY: those from each
    row's `row_lo` on) through the page table."""
    keys = j + tl.arange(0, BLOCK_N)  # [BN]
    key_valid = keys < hi
    kv_off = cache_slots(page_table_ptr, keys, key_valid, kv_head, stride_cp, stride_cs,
                         stride_ch, PAGE_SIZE)  # [BN]
    kv_ptrs = kv_off[:, None] + tl.arange(0, HEAD_DIM)[None, :]  # [BN, D]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    return attend_tile(q, _to_dot(k, DOT_F16), _to_dot(v, DOT_F16),
                        row_window(key_valid[None, :], keys, row_lo, PER_QUERY), scale_log2_k,
                        m_i, l_i, acc, DOT_FP32)


@triton.jit
def new_tile(
    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh, num_queries,
    scale_log2, m_i, l_i, acc, HEAD_DIM: tl.constexpr, CAUSAL_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, window=0, PER_QUERY: tl.constexpr = False,
):
    """Attend the block's own keys `j .. j+BLOCK_N-1` (BF16; block-causal if CAUSAL_BLOCK;
    PER_QUERY: key `s` visible to the query at `t` only if `s >= t - (window - 1)`)."""
    keys = j + tl.arange(0, BLOCK_N)  # [BN]
    key_valid = keys < num_queries
    kv_ptrs = keys[:, None] * stride_nt + kv_head * stride_nh + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    key_mask = key_valid[None, :] & (rows[:, None] >= 0)  # [BM, BN]
    if CAUSAL_BLOCK > 0:
        visible = (keys[None, :] // CAUSAL_BLOCK) <= (pos[:, None] // CAUSAL_BLOCK)
        key_mask = key_mask & visible
    key_mask = row_window(key_mask, keys, pos - (window - 1), PER_QUERY)
    return attend_tile(q, k.to(tl.bfloat16), v.to(tl.bfloat16), key_mask, scale_log2,
                        m_i, l_i, acc, DOT_FP32)


@triton.jit
def _visible_range(raw_prefix, max_tokens, window, WINDOWED: tl.constexpr):
    """(start, prefix) of the visible cached keys; start is the constant 0 without a window."""
    prefix = tl.minimum(raw_prefix, max_tokens)
    if WINDOWED:
        return tl.maximum(prefix - (window - 1), 0), prefix
    return 0, prefix


@triton.jit
def interleaved_tiles(start, prefix, BLOCK_N: tl.constexpr):
    """Key tiles that hold visible keys `[start, prefix)`: tiles `start // BLOCK_N` onwards."""
    return tl.where(prefix > start, tl.cdiv(prefix, BLOCK_N) - start // BLOCK_N, 0)


@triton.jit
def _speculative_tile(
    t, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp, stride_cs, stride_ch,
    max_tokens, num_pages, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys of tile `t` and their cached K/V, read before the prefix length is known.

    Page ids are read only below `max_tokens` (inside the table) and clamped to the pool, as
    entries past the live prefix may hold anything; the caller masks the scores.
    """
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_table = keys < max_tokens
    page = tl.load(page_table_ptr + keys // PAGE_SIZE, mask=in_table, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    kv_off = (page.to(tl.int64) * stride_cp + (keys % PAGE_SIZE) * stride_cs
              + kv_head * stride_ch)  # [BN]
    kv_ptrs = kv_off[:, None] + tl.arange(0, HEAD_DIM)[None, :]  # [BN, D]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=in_table[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=in_table[:, None], other=0.0)
    return keys, k, v


@triton.jit
def interleaved_split(
    q, split, kv_head, raw_prefix, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp,
    stride_cs, stride_ch, scale_log2_k, max_tokens, num_pages, window, m_i, l_i, acc,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SPEC_TILES: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_F16: tl.constexpr, LOOP_WHILE: tl.constexpr,
    NUM_STAGES: tl.constexpr, pos=0, PER_QUERY: tl.constexpr = False,
):
    """Attend key tiles `first + split + i * NUM_SPLITS`; returns (m, l, acc, nonempty).

    The first SPEC_TILES (1 or 2) tiles are loaded speculatively: without a window their keys
    do not depend on the prefix, so their page ids and K/V are in flight while `raw_prefix` (a
    pending load) arrives. Later tiles go through the software-pipelined loop. PER_QUERY
    (`window_per_query`): the row at block position `pos` sees keys from
    `prefix + pos - (window - 1)` on.
    """
    first = split  # without a window the first tile does not wait for the prefix
    if WINDOWED:
        start, _ = _visible_range(raw_prefix, max_tokens, window, WINDOWED)
        first += start // BLOCK_N
    keys0, k0, v0 = _speculative_tile(first, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                                      stride_cp, stride_cs, stride_ch, max_tokens, num_pages,
                                      HEAD_DIM, PAGE_SIZE, BLOCK_N)
    if SPEC_TILES > 1:
        keys1, k1, v1 = _speculative_tile(
            first + NUM_SPLITS, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp,
            stride_cs, stride_ch, max_tokens, num_pages, HEAD_DIM, PAGE_SIZE, BLOCK_N)
    start, prefix = _visible_range(raw_prefix, max_tokens, window, WINDOWED)
    row_lo = prefix + pos - (window - 1)  # [BM] (PER_QUERY only)
    last = start // BLOCK_N + interleaved_tiles(start, prefix, BLOCK_N)
    nonempty = first < last
    if nonempty:
        m_i, l_i, acc = attend_tile(q, _to_dot(k0, DOT_F16), _to_dot(v0, DOT_F16),
                                    row_window(((keys0 >= start) & (keys0 < prefix))[None, :],
                                               keys0, row_lo, PER_QUERY),
                                    scale_log2_k, m_i, l_i, acc, DOT_FP32)
        if SPEC_TILES > 1:  # noqa: SIM102 (static, around a runtime test)
            if first + NUM_SPLITS < last:  # past `start`: only the prefix bounds its keys
                m_i, l_i, acc = attend_tile(q, _to_dot(k1, DOT_F16), _to_dot(v1, DOT_F16),
                                            row_window((keys1 < prefix)[None, :], keys1, row_lo,
                                                       PER_QUERY),
                                            scale_log2_k, m_i, l_i, acc, DOT_FP32)
        if LOOP_WHILE:  # the interpreter cannot range over loaded scalars
            t = first + SPEC_TILES * NUM_SPLITS
            while t < last:
                m_i, l_i, acc = cache_tile(
                    q, t * BLOCK_N, prefix, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                    stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM,
                    PAGE_SIZE, BLOCK_N, DOT_FP32, DOT_F16, row_lo, PER_QUERY)
                t += NUM_SPLITS
        else:
            for t in tl.range(first + SPEC_TILES * NUM_SPLITS, last, NUM_SPLITS,
                              num_stages=NUM_STAGES):
                m_i, l_i, acc = cache_tile(
                    q, t * BLOCK_N, prefix, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                    stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM,
                    PAGE_SIZE, BLOCK_N, DOT_FP32, DOT_F16, row_lo, PER_QUERY)
    return m_i, l_i, acc, nonempty
