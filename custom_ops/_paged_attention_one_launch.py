"""One-launch Triton kernel of `dlmc::paged_attention`: split-K with the merge done in-kernel.

Same row packing and key splits as `_paged_attention_kernels.py` (rows = block positions x the
`GROUP` query heads of one KV head; the visible cached range cut on the device into at most
`NUM_SPLITS` chunks of at least `MIN_SPLIT_KEYS` keys). Differences:
- Grid `(cdiv(M, BLOCK_M), Hkv, NUM_SPLITS)`: no extra split for the block's own keys; the last
  live split attends them after its cached keys (it has the fewest cached keys).
- No merge kernel. The live splits of one (row block, KV head) merge in a tree of fan-in
  `FAN_IN`: at each level a program writes its partial (normalized output, log2-sum-exp) to its
  slot, then takes a ticket from an atomic counter of its parent node (`acq_rel`, GPU scope,
  after a CTA barrier so every thread's stores are ordered before it). The program that draws the
  last ticket knows its siblings are written: it sets the counter back to 0 (the next call, or
  graph replay, finds the workspace zeroed), folds the siblings' partials into its own
  (loads bypass L1: `.cg`) and goes up a level; the others stop. The root writes the output.
  With a single live split (short prefix) nothing is written to the workspace and no atomic runs.
- Counters: `[groups, LEVELS, cdiv(NUM_SPLITS, FAN_IN)]` int32, all zero between calls. Calls that
  may run concurrently (other streams) need their own counters.

Partial slots: the node `n` of level `l` (leaves are the splits, level 0) keeps its partial in
slot `n * FAN_IN**l` of `[NUM_SPLITS, Hkv, M, D]`: the slot of its first leaf, whose data its
merger has already read, so the slots are reused without a race.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._paged_attention_kernels import _cache_tile, _new_tile, _split_range


@triton.jit
def _store_partial(o_part_ptr, lse_part_ptr, slot, kv_head, num_kv_heads, num_rows, rows,
                   row_mask, dims, m_i, l_i, acc, HEAD_DIM: tl.constexpr):
    """Write (acc / l, m + log2 l) of BLOCK_M rows to partial slot `slot`."""
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    part = slot * num_kv_heads + kv_head
    tl.store(lse_part_ptr + part * num_rows + rows, m_i + tl.log2(safe_l), mask=row_mask)
    o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, acc / safe_l[:, None], mask=row_mask[:, None])


@triton.jit
def _fold_partial(o_part_ptr, lse_part_ptr, slot, live, kv_head, num_kv_heads, num_rows, rows,
                  row_mask, dims, m_i, l_i, acc, HEAD_DIM: tl.constexpr):
    """Fold the partial in slot `slot` (if `live`) into the online softmax state (m, l, acc).

    Written by another program of this launch: `.cg` loads read L2, never a stale L1 line.
    """
    mask = row_mask & live
    part = slot * num_kv_heads + kv_head
    lse = tl.load(lse_part_ptr + part * num_rows + rows, mask=mask, other=float("-inf"),
                  cache_modifier=".cg")  # [BM]
    o_ptrs = o_part_ptr + (part * num_rows + rows[:, None]) * HEAD_DIM + dims[None, :]
    o = tl.load(o_ptrs, mask=mask[:, None], other=0.0, cache_modifier=".cg")  # [BM, D]
    m_new = tl.maximum(m_i, lse)  # m_i is finite (>= -1e30), so no inf - inf
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(lse - m_new)  # 0 for dead slots and masked rows
    return m_new, l_i * alpha + beta, acc * alpha[:, None] + o * beta[:, None]


@triton.jit
def paged_attention_one_launch_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, prefix_len_ptr,
    k_scale_ptr, v_scale_ptr, o_part_ptr, lse_part_ptr, counters_ptr, out_ptr,
    stride_qt, stride_qh, stride_nt, stride_nh, stride_cp, stride_cs, stride_ch,
    stride_ot, stride_oh,
    num_queries, num_rows, scale_log2, max_tokens, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAN_IN: tl.constexpr, LEVELS: tl.constexpr,
    REVERSE_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, LOOP_WHILE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if REVERSE_SPLITS:  # tests: under the interpreter programs run in order; reverse it
        split = NUM_SPLITS - 1 - split
    num_kv_heads = tl.num_programs(1)
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as fp64

    start, prefix, per_split, live = _split_range(prefix_len_ptr, max_tokens, window,
                                                  NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_N)
    parts = tl.maximum(live, 1)  # the last part also attends the block's own keys
    if split < parts:
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

        # Cached keys [lo, hi) (empty when no cached key is visible).
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, prefix)
        scale_log2_k = scale_log2 * tl.load(k_scale_ptr)
        if LOOP_WHILE:  # the interpreter cannot range over loaded scalars
            j = lo
            while j < hi:
                m_i, l_i, acc = _cache_tile(
                    q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp,
                    stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM, PAGE_SIZE,
                    BLOCK_N, DOT_FP32)
                j += BLOCK_N
        else:
            for j in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = _cache_tile(
                    q, j, hi, kv_head, page_table_ptr, k_cache_ptr, v_cache_ptr, stride_cp,
                    stride_cs, stride_ch, scale_log2_k, m_i, l_i, acc, HEAD_DIM, PAGE_SIZE,
                    BLOCK_N, DOT_FP32)
        acc = acc * tl.load(v_scale_ptr)  # FP8 V scale, before the BF16 block values join

        if split == parts - 1:  # the block's own keys: bidirectional, or block-causal
            if LOOP_WHILE:
                j = tl.full([], 0, tl.int32)
                while j < num_queries:
                    m_i, l_i, acc = _new_tile(
                        q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                        num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK,
                        BLOCK_N, DOT_FP32)
                    j += BLOCK_N
            else:
                for j in tl.range(0, num_queries, BLOCK_N):
                    m_i, l_i, acc = _new_tile(
                        q, j, rows, pos, kv_head, k_new_ptr, v_new_ptr, stride_nt, stride_nh,
                        num_queries, scale_log2, m_i, l_i, acc, HEAD_DIM, CAUSAL_BLOCK,
                        BLOCK_N, DOT_FP32)

        # Merge tree: the last program to finish among FAN_IN siblings merges them.
        nodes: tl.constexpr = (NUM_SPLITS + FAN_IN - 1) // FAN_IN  # counters per level
        group = pid_m * num_kv_heads + kv_head
        node = split  # this program's node at the current level
        count = parts  # live nodes at the current level
        active = split < parts  # still carrying a partial up the tree
        for level in tl.static_range(LEVELS):  # node n of level l keeps slot n * FAN_IN**l
            parent = node // FAN_IN
            first = parent * FAN_IN
            siblings = tl.minimum(count - first, FAN_IN)
            if active & (siblings > 1):
                _store_partial(o_part_ptr, lse_part_ptr, node * FAN_IN**level, kv_head,
                               num_kv_heads, num_rows, rows, row_mask, dims, m_i, l_i, acc,
                               HEAD_DIM)
                tl.debug_barrier()  # every thread's partial is stored before the ticket
                counter = counters_ptr + (group * LEVELS + level) * nodes + parent
                ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                last = ticket == siblings - 1
                if last:
                    tl.store(counter, 0)  # left zeroed for the next call
                    for c in range(FAN_IN):  # a loop, not unrolled: one partial in registers
                        sibling = first + c
                        m_i, l_i, acc = _fold_partial(
                            o_part_ptr, lse_part_ptr, sibling * FAN_IN**level,
                            (c < siblings) & (sibling != node), kv_head, num_kv_heads, num_rows,
                            rows, row_mask, dims, m_i, l_i, acc, HEAD_DIM)
                active = last
            node = parent
            count = tl.cdiv(count, FAN_IN)

        if active:  # the root: the whole key range is merged
            safe_l = tl.where(l_i > 0.0, l_i, 1.0)
            out = (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + pos[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(o_ptrs, out, mask=row_mask[:, None])


def one_launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the split kernel's, with 32 rows above D = 128 (the merge's
    partial next to the accumulator spilled registers at 64 x 256 on sm_90)."""
    if head_dim <= 128:
        return 64, 64, 4
    return 32, 32, 8


def merge_levels(num_splits: int, fan_in: int) -> int:
    """Levels of the merge tree: the fewest `L` with `fan_in**L >= num_splits`."""
    levels, reach = 0, 1
    while reach < num_splits:
        levels, reach = levels + 1, reach * fan_in
    return levels


def num_counters(num_rows: int, num_kv_heads: int, num_splits: int, block_m: int,
                 fan_in: int) -> int:
    """Workspace counters one call uses: groups x merge levels x nodes per level."""
    groups = triton.cdiv(num_rows, block_m) * num_kv_heads
    return groups * merge_levels(num_splits, fan_in) * triton.cdiv(num_splits, fan_in)
