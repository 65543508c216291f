"""Triton merge kernels of `dlmc::paged_attention`: combine the splits' partial outputs.

Each split `s` of `_paged_attention_kernels.py` wrote, for its live rows, a normalized partial
output `o_part[s, kv_head, row]` (`[D]`, fp32 or bf16) and its log2-sum-exp `lse_part[s, ...]`;
part `NUM_SPLITS` is the block's own keys and is always written. Splits that found no keys
wrote nothing, so the merge works out from the device prefix which parts are live.

- `paged_attention_merge_kernel` (today's default): one program per (row, KV head); the own part,
  then the prefix, then the live parts in chunks of CHUNK: three dependent memory round trips.
- `paged_attention_merge_flat_kernel`: ROWS rows per program; the prefix and the own part are
  loaded together, then every cache part at once (statically unrolled chunks, so their loads
  overlap): two round trips. SPECULATIVE loads the cache parts without waiting for the prefix
  and drops the dead ones afterwards (one round trip; dead parts are read, never used). PDL:
  launched with programmatic dependent launch, it reads the prefix (written before the split
  kernel's own wait) and then waits for the split grid before touching the parts.

Loops are `while` loops because the interpreter (numpy >= 2) cannot index with loaded scalars.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._paged_attention_tiles import interleaved_tiles, split_range


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
    _, _, _, live = split_range(tl.load(prefix_len_ptr), max_tokens, window, NUM_SPLITS,
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


@triton.jit
def _live_splits(raw_prefix, max_tokens, window, NUM_SPLITS: tl.constexpr,
                 MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """Cache splits that found keys (and wrote a part), by the split kernel's own rule."""
    start, prefix, _, live = split_range(raw_prefix, max_tokens, window, NUM_SPLITS,
                                          MIN_SPLIT_KEYS, BLOCK_N)
    if INTERLEAVED:
        return tl.minimum(interleaved_tiles(start, prefix, BLOCK_N), NUM_SPLITS)
    return live


@triton.jit
def paged_attention_merge_flat_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, prefix_len_ptr, stride_ot, stride_oh, num_rows,
    max_tokens, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr,
    SPECULATIVE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (ROWS rows, KV head): the own part and every live cache part."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    row_mask = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    # Not written by the split kernel, and the split only lets this grid start after its own
    # wait for the kernels before it: no wait needed for the prefix.
    raw_prefix = tl.load(prefix_len_ptr)
    if PDL:
        gdc_wait()  # the split grid's parts are visible from here on
        gdc_launch_dependents()  # the next kernel may start (and wait) while this one runs
    own = (NUM_SPLITS * num_kv_heads + kv_head) * num_rows + rows  # [R]
    m_i = tl.load(lse_part_ptr + own, mask=row_mask, other=0.0)  # [R], the own part is live
    l_i = tl.full([ROWS], 1.0, tl.float32)
    acc = tl.load(o_part_ptr + own[:, None] * HEAD_DIM + dims[None, :],
                  mask=row_mask[:, None], other=0.0).to(tl.float32)  # [R, D]
    live = _live_splits(raw_prefix, max_tokens, window, NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_N,
                        INTERLEAVED)
    for first in tl.static_range(0, NUM_SPLITS, CHUNK):  # unrolled: the loads all overlap
        parts = first + tl.arange(0, CHUNK)  # [C]
        if SPECULATIVE:
            load = (parts < NUM_SPLITS)[None, :] & row_mask[:, None]  # [R, C]
        else:
            load = (parts < live)[None, :] & row_mask[:, None]
        index = (parts[None, :] * num_kv_heads + kv_head) * num_rows + rows[:, None]  # [R, C]
        lse = tl.load(lse_part_ptr + index, mask=load, other=float("-inf"))  # [R, C]
        o = tl.load(o_part_ptr + index[:, :, None] * HEAD_DIM + dims[None, None, :],
                    mask=load[:, :, None], other=0.0).to(tl.float32)  # [R, C, D]
        if SPECULATIVE:  # dead parts hold stale data: select, never multiply, them away
            alive = (parts < live)[None, :]
            lse = tl.where(alive, lse, float("-inf"))
            o = tl.where(alive[:, :, None], o, 0.0)
        m_new = tl.maximum(m_i, tl.max(lse, axis=1))  # [R]
        w = tl.exp2(lse - m_new[:, None])  # [R, C], 0 for dead parts
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m_i = m_new
    pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + pos[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :], out,
             mask=row_mask[:, None])


def merge_chunk(num_splits: int) -> int:
    """Cache parts the merge loads at once (all of them, up to 32)."""
    return min(triton.next_power_of_2(max(num_splits, 2)), 32)


def flat_merge_config(num_splits: int, rows: int, head_dim: int) -> tuple[int, int]:
    """(CHUNK, num_warps) of the flat merge: chunks of at most 16K values, ~32 per thread."""
    chunk = min(triton.next_power_of_2(num_splits), max(1, 16384 // (rows * head_dim)))
    values = rows * chunk * head_dim
    return chunk, min(16, max(4, values // 1024))
