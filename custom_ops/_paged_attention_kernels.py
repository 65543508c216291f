"""Triton kernels of `dlmc::paged_attention`: split-K partial attention and the merge.

Layout of the work (flash-decoding for a block of queries):
- Rows: the `GROUP = Hq // Hkv` query heads that share one KV head are packed with the block's
  `Tq` positions into `M = Tq * GROUP` rows (row `r` is position `r // GROUP`, query head
  `kv_head * GROUP + r % GROUP`), so one K/V tile load serves every query of the KV head.
- Keys: the visible cached range `[start, prefix_len)` is cut into `NUM_SPLITS` contiguous chunks
  (chunk length is computed on the device from `prefix_len`, at least `MIN_SPLIT_KEYS`); one more
  split (index `NUM_SPLITS`) attends the block's own keys. The grid is
  `(cdiv(M, BLOCK_M), Hkv, NUM_SPLITS + 1)` whatever the prefix: empty splits only write an LSE of
  -inf, so the launch is CUDA-graph safe.
- Each split writes a normalized partial output `[M, D]` (fp32) and its log2-sum-exp; the merge
  kernel combines them with an online softmax.

Loops are `while` loops because the interpreter (numpy >= 2) cannot index with loaded scalars.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _attend_tile(
    q, k, v, key_mask, scale_log2, m_i, l_i, acc, DOT_FP32: tl.constexpr
):  # q [BM, D] bf16, k/v [BN, D] bf16, key_mask [BM, BN]
    scores = _dot(q, tl.trans(k), DOT_FP32) * scale_log2  # [BM, BN] fp32, log2 domain
    scores = tl.where(key_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BM]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), v, DOT_FP32)  # [BM, D]
    return m_new, l_i, acc


@triton.jit
def _split_range(prefix_len_ptr, max_tokens, window, NUM_SPLITS: tl.constexpr,
                 MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, prefix, keys per split, live splits) of the visible cached range, on device."""
    prefix = tl.minimum(tl.load(prefix_len_ptr), max_tokens)
    start = tl.where(window > 0, tl.maximum(prefix - (window - 1), 0), 0)
    per_split = tl.cdiv(tl.cdiv(prefix - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, MIN_SPLIT_KEYS)
    return start, prefix, per_split, tl.cdiv(prefix - start, per_split)


@triton.jit
def _cache_tile(
    q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp, stride_cs,
    stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Attend cached keys `j .. j+BLOCK_N-1` (those below `hi`) through the page table."""
    keys = j + tl.arange(0, BLOCK_N)  # [BN]
    key_valid = keys < hi
    page = tl.load(page_table_ptr + keys // PAGE_SIZE, mask=key_valid, other=0)
    kv_off = (page.to(tl.int64) * stride_cp + (keys % PAGE_SIZE) * stride_cs
              + kv_head * stride_ch)  # [BN]
    kv_ptrs = kv_off[:, None] + tl.arange(0, HEAD_DIM)[None, :]  # [BN, D]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    return _attend_tile(q, _to_bf16(k), _to_bf16(v), key_valid[None, :], scale_log2_k,
                        m_i, l_i, acc, DOT_FP32)


@triton.jit
def _new_tile(
    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh, num_queries,
    scale_log2, m_i, l_i, acc, HEAD_DIM: tl.constexpr, CAUSAL_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Attend the block's own keys `j .. j+BLOCK_N-1` (BF16; block-causal if CAUSAL_BLOCK)."""
    keys = j + tl.arange(0, BLOCK_N)  # [BN]
    key_valid = keys < num_queries
    kv_ptrs = keys[:, None] * stride_nt + kv_head * stride_nh + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
    key_mask = key_valid[None, :] & (rows[:, None] >= 0)  # [BM, BN]
    if CAUSAL_BLOCK > 0:
        visible = (keys[None, :] // CAUSAL_BLOCK) <= (pos[:, None] // CAUSAL_BLOCK)
        key_mask = key_mask & visible
    return _attend_tile(q, k.to(tl.bfloat16), v.to(tl.bfloat16), key_mask, scale_log2,
                        m_i, l_i, acc, DOT_FP32)


@triton.jit
def paged_attention_split_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, prefix_len_ptr,
    k_scale_ptr, v_scale_ptr, o_part_ptr, lse_part_ptr,
    stride_qt, stride_qh, stride_nt, stride_nh,
    stride_cp, stride_cs, stride_ch,
    num_queries, num_rows, scale_log2, max_tokens, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    LOOP_WHILE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as fp64

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < num_rows
    pos = rows // GROUP  # block position of each row
    head = kv_head * GROUP + rows % GROUP  # query head of each row
    dims = tl.arange(0, HEAD_DIM)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if split < NUM_SPLITS:
        # Cached keys [lo, hi) of this split; the range is computed from the device prefix.
        start, prefix, per_split, _ = _split_range(prefix_len_ptr, max_tokens, window,
                                                   NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_N)
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, prefix)
        nonempty = lo < hi
        if nonempty:
            q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
            q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16
            scale_log2_k = scale_log2 * tl.load(k_scale_ptr)
            if LOOP_WHILE:  # the interpreter cannot range over loaded scalars
                j = lo
                while j < hi:
                    m_i, l_i, acc = _cache_tile(
                        q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                        stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_FP32)
                    j += BLOCK_N
            else:
                for j in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
                    m_i, l_i, acc = _cache_tile(
                        q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                        stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_FP32)
            acc = acc * tl.load(v_scale_ptr)
    else:
        # The block's own keys (BF16, not in the cache): bidirectional, or block-causal.
        nonempty = num_queries > 0
        q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16
        if LOOP_WHILE:
            j = tl.full([], 0, tl.int32)
            while j < num_queries:
                m_i, l_i, acc = _new_tile(
                    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                    num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK, BLOCK_N,
                    DOT_FP32)
                j += BLOCK_N
        else:
            for j in tl.range(0, num_queries, BLOCK_N):
                m_i, l_i, acc = _new_tile(
                    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                    num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK, BLOCK_N,
                    DOT_FP32)

    if nonempty:  # empty splits write nothing: the merge reads only the live ones
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        lse = m_i + tl.log2(safe_l)  # [BM]
        part = split * num_kv_heads + kv_head
        tl.store(lse_part_ptr + part * num_rows + rows, lse, mask=row_mask)
        o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(o_ptrs, acc / safe_l[:, None], mask=row_mask[:, None])


@triton.jit
def _merge_chunk(o_part_ptr, lse_part_ptr, first, count, row, kv_head, num_kv_heads, dims,
                 m_i, l_i, acc, num_rows, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Fold parts `first .. first+count-1` (at most CHUNK, loaded at once) into (m, l, acc)."""
    parts = first + tl.arange(0, CHUNK)  # [C]
    live = parts < first + count
    index = (parts * num_kv_heads + kv_head) * num_rows + row  # [C]
    lse = tl.load(lse_part_ptr + index, mask=live, other=float("-inf"))  # [C]
    o = tl.load(o_part_ptr + index[:, None] * HEAD_DIM + dims[None, :], mask=live[:, None],
                other=0.0)  # [C, D] fp32
    m_new = tl.maximum(m_i, tl.max(lse, axis=0))
    w = tl.exp2(lse - m_new)  # [C], 0 for dead parts
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(w, axis=0), acc * alpha + tl.sum(w[:, None] * o, axis=0)


@triton.jit
def paged_attention_merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, prefix_len_ptr, stride_ot, stride_oh, num_rows,
    max_tokens, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    LOOP_WHILE: tl.constexpr,
):
    """One program per (row, KV head): the block's own part plus the live cache splits.

    The live count comes from the prefix on the device; up to CHUNK parts are loaded at once,
    so a prefix needs one or two dependent memory round trips.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([], -1.0e30, tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    m_i, l_i, acc = _merge_chunk(o_part_ptr, lse_part_ptr, NUM_SPLITS, 1, row, kv_head,
                                 num_kv_heads, dims, m_i, l_i, acc, num_rows, HEAD_DIM, 2)
    _, _, _, live = _split_range(prefix_len_ptr, max_tokens, window, NUM_SPLITS,
                                 MIN_SPLIT_KEYS, BLOCK_N)
    if LOOP_WHILE:
        first = 0
        while first < live:
            m_i, l_i, acc = _merge_chunk(
                o_part_ptr, lse_part_ptr, first, tl.minimum(live - first, CHUNK), row, kv_head,
                num_kv_heads, dims, m_i, l_i, acc, num_rows, HEAD_DIM, CHUNK)
            first += CHUNK
    else:
        for first in tl.range(0, live, CHUNK):
            m_i, l_i, acc = _merge_chunk(
                o_part_ptr, lse_part_ptr, first, tl.minimum(live - first, CHUNK), row, kv_head,
                num_kv_heads, dims, m_i, l_i, acc, num_rows, HEAD_DIM, CHUNK)
    pos = row // GROUP
    head = kv_head * GROUP + row % GROUP
    out = (acc / l_i).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + pos * stride_ot + head * stride_oh + dims, out)


def split_launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split kernel for a head dim."""
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 64, 32, 8
    return 32, 32, 8


def merge_chunk(num_splits: int) -> int:
    """Cache parts the merge loads at once (all of them, up to 32)."""
    return min(triton.next_power_of_2(max(num_splits, 2)), 32)
