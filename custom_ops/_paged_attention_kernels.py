"""Triton split kernel of `dlmc::paged_attention`: split-K partial attention.

Layout of the work (flash-decoding for a block of queries):
- Rows: the `GROUP = Hq // Hkv` query heads that share one KV head are packed with the block's
  `Tq` positions into `M = Tq * GROUP` rows (row `r` is position `r // GROUP`, query head
  `kv_head * GROUP + r % GROUP`), so one K/V tile load serves every query of the KV head.
- Keys: the visible cached range `[start, prefix_len)` is cut into `NUM_SPLITS` contiguous chunks
  (chunk length is computed on the device from `prefix_len`, at least `MIN_SPLIT_KEYS`), or, with
  INTERLEAVED, split `s` takes the key tiles `s, s + NUM_SPLITS, ...` (tile `t` = keys
  `[t*BLOCK_N, (t+1)*BLOCK_N)`), so that without a window its first tile's page ids and K/V are
  loaded before `prefix_len` arrives; one more split (index `NUM_SPLITS`) attends the block's
  own keys. The grid is `(cdiv(M, BLOCK_M), Hkv, NUM_SPLITS + 1)` whatever the prefix: empty
  splits write nothing, so the launch is CUDA-graph safe.
- Each split writes a normalized partial output `[M, D]` (fp32, or bf16 when `o_part` is bf16)
  and its log2-sum-exp; a merge kernel (`_paged_attention_merge.py`) combines them. Tiles and
  key ranges: `_paged_attention_tiles.py`.

Loops are `while` loops because the interpreter (numpy >= 2) cannot index with loaded scalars.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._paged_attention_tiles import cache_tile, interleaved_split, new_tile, split_range
from .kv_append import append_tokens


@triton.jit
def paged_attention_split_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, prefix_len_ptr,
    k_scale_ptr, v_scale_ptr, o_part_ptr, lse_part_ptr,
    stride_qt, stride_qh, stride_nt, stride_nh,
    stride_cp, stride_cs, stride_ch,
    num_queries, num_rows, scale_log2, max_tokens, num_pages, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    LOOP_WHILE: tl.constexpr, NUM_STAGES: tl.constexpr, WINDOWED: tl.constexpr,
    INTERLEAVED: tl.constexpr, DOT_F16: tl.constexpr, PDL: tl.constexpr,
    OWN_STAGES: tl.constexpr, SPEC_TILES: tl.constexpr, APPEND: tl.constexpr,
    APPEND_T: tl.constexpr, EMULATE_FP8: tl.constexpr, WINDOW_PER_QUERY: tl.constexpr = False,
):
    """One program per (row block, KV head, split); see the module docstring.

    WINDOWED must be `window > 0`. INTERLEAVED: the tile order above, the first SPEC_TILES
    tiles of each split loaded before the prefix length arrives. DOT_F16: FP8 cache tiles
    and q as FP16 dot operands (q must stay below 65504 in magnitude). PDL (programmatic
    dependent launch): this grid may start before the previous kernel ends, so it waits for
    it before reading anything, then lets the merge start while it runs. OWN_STAGES:
    pipelining stages of the block's own-key loop (its BF16 buffers set the shared memory).
    APPEND: row block 0 of the own-key split (one program per KV head) also stores the block's
    K/V at positions `prefix_len + t`, APPEND_T tokens at a time, after its partial output
    (`kv_append`'s code: same FP8 rounding, EMULATE_FP8 under the interpreter, positions past
    capacity dropped), so each token of each KV head is stored exactly once whatever BLOCK_M.
    WINDOW_PER_QUERY (with WINDOWED): the window moves with each query, the row at block
    position `t` seeing keys from `prefix_len + t - (window - 1)` on, cached and own (a causal
    chunk's sliding window); the splits still cut the range anchored at the block start, the
    union of the rows' windows.
    A separate pass, not the attention loop's tiles: storing those raised the registers from
    161-168 to 250-255 at D=128 (spilling). Cache splits read only keys below `prefix_len`
    (interleaved speculative tiles mask what they read past it), so the output is unchanged.
    """
    if PDL:
        gdc_wait()  # whatever wrote q, k/v, the cache or the prefix has finished
        gdc_launch_dependents()
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
        if INTERLEAVED:
            raw_prefix = tl.load(prefix_len_ptr)  # issued first, waited for after the K/V loads
            q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
            q_dot = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16
            if DOT_F16:
                q_dot = q_dot.to(tl.float16)
            m_i, l_i, acc, nonempty = interleaved_split(
                q_dot, split, kv_head, raw_prefix, page_table_ptr, k_cache_ptr, v_cache_ptr,
                stride_cp, stride_cs, stride_ch, scale_log2 * tl.load(k_scale_ptr), max_tokens,
                num_pages, window, m_i, l_i, acc, NUM_SPLITS, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                WINDOWED, SPEC_TILES, DOT_FP32, DOT_F16, LOOP_WHILE, NUM_STAGES, pos,
                WINDOW_PER_QUERY)
            acc = acc * tl.load(v_scale_ptr)
        else:
            # Cached keys [lo, hi) of this split; the range is computed from the device prefix.
            start, prefix, per_split, _ = split_range(tl.load(prefix_len_ptr), max_tokens, window,
                                                       NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_N)
            lo = start + split * per_split
            hi = tl.minimum(lo + per_split, prefix)
            row_lo = prefix + pos - (window - 1)  # [BM] (WINDOW_PER_QUERY only)
            nonempty = lo < hi
            if nonempty:
                q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
                q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16
                scale_log2_k = scale_log2 * tl.load(k_scale_ptr)
                if LOOP_WHILE:  # the interpreter cannot range over loaded scalars
                    j = lo
                    while j < hi:
                        m_i, l_i, acc = cache_tile(
                            q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                            stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_FP32, False, row_lo,
                            WINDOW_PER_QUERY)
                        j += BLOCK_N
                else:
                    for j in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
                        m_i, l_i, acc = cache_tile(
                            q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr,
                            stride_cp, stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_FP32, False, row_lo,
                            WINDOW_PER_QUERY)
                acc = acc * tl.load(v_scale_ptr)
    else:
        # The block's own keys (BF16, not in the cache): bidirectional, or block-causal.
        nonempty = num_queries > 0
        q_off = pos[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BM, D] bf16
        if LOOP_WHILE:
            j = tl.full([], 0, tl.int32)
            while j < num_queries:
                m_i, l_i, acc = new_tile(
                    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                    num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK, BLOCK_N,
                    DOT_FP32, window, WINDOW_PER_QUERY)
                j += BLOCK_N
        else:
            for j in tl.range(0, num_queries, BLOCK_N, num_stages=OWN_STAGES):
                m_i, l_i, acc = new_tile(
                    q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                    num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK, BLOCK_N,
                    DOT_FP32, window, WINDOW_PER_QUERY)

    if nonempty:  # empty splits write nothing: the merge reads only the live ones
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        lse = m_i + tl.log2(safe_l)  # [BM]
        part = split * num_kv_heads + kv_head
        tl.store(lse_part_ptr + part * num_rows + rows, lse, mask=row_mask)
        o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(o_ptrs, (acc / safe_l[:, None]).to(o_part_ptr.dtype.element_ty),
                 mask=row_mask[:, None])
    if APPEND:  # noqa: SIM102 (static, around a runtime test)
        if (split == NUM_SPLITS) & (pid_m == 0):  # one program per KV head stores the block
            t = tl.full([], 0, tl.int32)
            while t < num_queries:
                append_tokens(
                    k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr,
                    prefix_len_ptr, k_scale_ptr, v_scale_ptr, t + tl.arange(0, APPEND_T),
                    kv_head, num_queries, max_tokens, stride_nt, stride_nh, stride_nt, stride_nh,
                    stride_cp, stride_cs, stride_ch, HEAD_DIM, PAGE_SIZE,
                    k_cache_ptr.dtype.element_ty.is_fp8(), EMULATE_FP8)
                t += APPEND_T


def split_launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split kernel for a head dim."""
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 64, 32, 4
    return 64, 32, 8
