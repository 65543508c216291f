"""The routing-weighted combine inside the Gluon down kernel (`DLMC_NVFP4_DOWN_COMBINE`).

Without it `nvfp4_moe` ends with a launch of its own, `moe_combine`, which waits for the whole
down launch and then sums each token's K pair rows. Here the down kernel's consumer warps do
it: every item (8 slots, one 128-column N-tile) counts its pairs on a counter per (token,
N-tile) after its y rows are stored (a barrier of the four consumer warps, then one release
increment per pair), and the item that brings a counter to K sums that token's K rows of the
tile in fp32 in pair order (`w[t, k] * y[t*K + k]`, k ascending, as `moe_combine_kernel`
does: the same bits), writes `out[t]` in bf16 and zeroes the counter for the next launch.

The counts are issued one item late and read one item later still (`finish_pairs` after the
next item's K loop), so neither the release fence nor the atomic's round trip stalls the
consumers in the steady state: by then the item's stores and the counts have long completed.
Each consumer thread holds one element of a 128-wide line (`LINE`), the first 8 the item's
slots, so every atomic has one owner and its result stays in that thread; the thread that saw
the last count fences (acquire) before the barrier that hands the news to the others, which
then read the rows from L2 (`.cg`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dlmc.env import env_choice

__all__ = ["COMBINE", "LINE", "count_pairs", "down_combine", "finish_pairs"]

# DLMC_NVFP4_DOWN_COMBINE (read at import): "1" (the combine in the down kernel, where the op's
# gate/up and down both run in Gluon without a shared expert and it returns combined rows) or
# "0" (`moe_combine`'s launch after it). The module's value may be set per call by benches.
COMBINE = env_choice("DLMC_NVFP4_DOWN_COMBINE", "1", ("1", "0")) == "1"

LINE = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # [128]: one per consumer thread


def down_combine() -> bool:
    """`COMBINE` as now set."""
    return COMBINE


@gluon.jit
def count_pairs(comb_ptr, sorted_pair_ptr, num_pairs, slot0, tile, live,
                TOP_K: gl.constexpr, TILES: gl.constexpr):
    """Once the item (slots slot0.., N-tile `tile`; nothing unless `live`) has stored its y
    rows: one release count per pair on its (token, tile) counter. Returns (token or -1, the
    count before), both [128] in `LINE` (slots 0-7 in threads 0-7)."""
    j = gl.arange(0, 128, LINE)
    pair = gl.load(sorted_pair_ptr + slot0 + j, mask=(j < 8) & (live != 0), other=num_pairs)
    token = gl.where(pair < num_pairs, pair // TOP_K, -1)
    gl.thread_barrier()  # every consumer warp's stores of the item first
    old = gl.atomic_add(comb_ptr + token * TILES + tile, gl.full_like(token, 1),
                        mask=token >= 0, sem="release",
                        scope="gpu")
    return token, old


@gluon.jit
def _acquire_if(last):
    """The threads whose count was the last (`last` != 0) fence (acquire), so that the other
    writers' rows, released before their counts, are visible after the next barrier."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $1, 0; @p fence.acq_rel.gpu; mov.b32 $0, $1; }",
        "=r,r", [last], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _combine_token(y_ptr, w_ptr, out_ptr, token, tile, stride_y, stride_wt, stride_wk,
                   stride_out, TOP_K: gl.constexpr):
    """out[token, tile's 128 columns] = bf16(sum_k w[token, k] * y[token*K + k, ...]) in fp32,
    k ascending."""
    cols = tile * 128 + gl.arange(0, 128, LINE)
    t = token.to(gl.int64)
    acc = gl.zeros([128], gl.float32, LINE)
    for k in gl.static_range(TOP_K):
        weight = gl.load(w_ptr + t * stride_wt + k * stride_wk)
        row = gl.load(y_ptr + (t * TOP_K + k) * stride_y + cols, cache_modifier=".cg")
        acc += weight * row.to(gl.float32)
    gl.store(out_ptr + t * stride_out + cols, acc.to(gl.bfloat16))


@gluon.jit
def finish_pairs(comb_ptr, y_ptr, w_ptr, out_ptr, stride_y, stride_wt, stride_wk, stride_out,
                 token, old, tile, TOP_K: gl.constexpr, TILES: gl.constexpr):
    """For `count_pairs`' result (token, old): each token whose K-th count of `tile` it was
    gets its combined row; its counter goes back to zero."""
    j = gl.arange(0, 128, LINE)
    last = ((token >= 0) & (old == TOP_K - 1)).to(gl.int32)
    gl.atomic_xchg(comb_ptr + token * TILES + tile, gl.zeros_like(token), mask=last != 0,
                   sem="relaxed",
                   scope="gpu")
    last = _acquire_if(last)
    done = gl.sum(gl.where(last != 0, 1 << (j % 8), 0), axis=0)  # (a barrier: the news)
    if done != 0:
        for r in gl.static_range(8):
            if (done >> r) & 1:
                t = gl.max(gl.where(j == r, token, -1), axis=0)
                _combine_token(y_ptr, w_ptr, out_ptr, t, tile, stride_y, stride_wt, stride_wk,
                               stride_out, TOP_K)
