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
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < num_rows
    pos = rows // GROUP  # block position of each row
    head = kv_head * GROUP + rows % GROUP  # query head of each row
    dims = tl.arange(0, HEAD_DIM)
    q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if split < NUM_SPLITS:
        # Cached keys [lo, hi) of this split; the range is computed from the device prefix.
        prefix = tl.minimum(tl.load(prefix_len_ptr), max_tokens)
        start = tl.where(window > 0, tl.maximum(prefix - (window - 1), 0), 0)
        per_split = tl.cdiv(tl.cdiv(prefix - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        per_split = tl.maximum(per_split, MIN_SPLIT_KEYS)
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, prefix)
        nonempty = lo < hi
        scale_log2_k = scale_log2 * tl.load(k_scale_ptr)
        j = lo
        while j < hi:
            keys = j + tl.arange(0, BLOCK_N)  # [BN]
            key_valid = keys < hi
            page = tl.load(page_table_ptr + keys // PAGE_SIZE, mask=key_valid, other=0)
            kv_off = (page.to(tl.int64) * stride_cp + (keys % PAGE_SIZE) * stride_cs
                      + kv_head * stride_ch)  # [BN]
            kv_ptrs = kv_off[:, None] + dims[None, :]  # [BN, D]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile(
                q, _to_bf16(k), _to_bf16(v), key_valid[None, :], scale_log2_k,
                m_i, l_i, acc, DOT_FP32,
            )
            j += BLOCK_N
        acc = acc * tl.load(v_scale_ptr)
    else:
        # The block's own keys (BF16, not in the cache): bidirectional, or block-causal.
        nonempty = num_queries > 0
        j = tl.full([], 0, tl.int32)
        while j < num_queries:
            keys = j + tl.arange(0, BLOCK_N)  # [BN]
            key_valid = keys < num_queries
            kv_ptrs = keys[:, None] * stride_nt + kv_head * stride_nh + dims[None, :]
            k = tl.load(k_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_new_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
            key_mask = key_valid[None, :] & (rows[:, None] >= 0)  # [BM, BN]
            if CAUSAL_BLOCK > 0:
                visible = (keys[None, :] // CAUSAL_BLOCK) <= (pos[:, None] // CAUSAL_BLOCK)
                key_mask = key_mask & visible
            m_i, l_i, acc = _attend_tile(
                q, k.to(tl.bfloat16), v.to(tl.bfloat16), key_mask, scale_log2, m_i, l_i, acc,
                DOT_FP32,
            )
            j += BLOCK_N

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))  # [BM]
    part = split * num_kv_heads + kv_head
    tl.store(lse_part_ptr + part * num_rows + rows, lse, mask=row_mask)
    o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, acc / safe_l[:, None], mask=row_mask[:, None] & nonempty)


@triton.jit
def paged_attention_merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, stride_ot, stride_oh, num_rows,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for split in tl.static_range(NUM_PARTS):
        part = split * num_kv_heads + kv_head
        lse = tl.load(lse_part_ptr + part * num_rows + rows, mask=row_mask, other=float("-inf"))
        live = lse > float("-inf")  # [BM]
        o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
        o = tl.load(o_ptrs, mask=live[:, None], other=0.0)  # [BM, D] fp32
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.where(live, tl.exp2(lse - m_new), 0.0)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    out_off = pos[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def split_launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split kernel for a head dim."""
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 64, 32, 8
    return 32, 32, 8


def merge_block_m(head_dim: int) -> int:
    """Rows per program of the merge kernel (keeps the fp32 accumulator in registers)."""
    return max(16, 8192 // head_dim)
