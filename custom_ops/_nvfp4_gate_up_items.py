"""The gate/up items of the Gluon gate/up kernel (`_nvfp4_gate_up_gluon`).

A gate/up item is an 8-slot part of a routing block and a 128-row N-tile of I. Per K-step of H
the producer copies the gate and up chunks (8 KB each, v7's words), their codes (1 KB each) and
the part's 8 x rows (eight [1, 128] boxes, gathered per token) into a ring slot
(`gate_up_copies`); the consumer warps decode both chunks as the MMA's A operand with the x
rows as B (even and odd K, `x_operands`) and store `silu(gate) * up` in bf16, each 128
columns even first (what the Gluon down kernel reads), then count the item done on its
routing block's counter (`gate_up_item`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from dlmc.custom_ops._nvfp4_gluon_parts import (
    MMA,
    _chunk,
    _mma_chunk,
    _store_tile,
    _tag_slot,
    gdc_launch_dependents,
    gdc_wait,
    operand_layout,
    tab_scalar,
)
from dlmc.custom_ops._nvfp4_gluon_ring import release_slot, wait_slot

__all__ = ["X_L", "gate_up_copies", "gate_up_item", "x_layout", "x_operands"]

# x rows of an 8-slot part, one K-step [8 slots, 128 K]: a thread holds 8 consecutive K
# (registers: K bits 0-2, then 5-6), lanes K bits 3-4 and the slot; each of the four consumer
# warps holds all of it (zero warp bases), as the B operand's warps do
X_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[8, 128]))


@gluon.jit
def x_operands(x):
    """x [8 slots, 128 K] -> the B operands [64 k', 8] of the even-K and odd-K MMAs."""
    even, odd = gl.split(gl.reshape(x, [8, 64, 2]))
    return (gl.convert_layout(gl.permute(even, [1, 0]), operand_layout(1, 4)),
            gl.convert_layout(gl.permute(odd, [1, 0]), operand_layout(1, 4)))


def x_layout() -> object:
    """The x rows' TMA box (bf16 [1, 128], one token row's K-step) in shared memory:
    unswizzled, so that a ring slot's 8 boxes are one [8, 128] tile."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _x_copies(x_d, x_slot, bar, sorted_pair_ptr, slot0, num_pairs, a_row_div, k, pair_tab,
              g, SELF: gl.constexpr):
    """TMA copies of K-step k of the part's 8 x rows (pair p reads row p // `a_row_div`;
    padding slots row 0) into the slot's [8, 128] tile; the pairs from the alignment, or
    (`SELF`) rows 8 g.. of the program's own table (`_nvfp4_self_route`)."""
    for r in gl.static_range(8):
        if SELF:  # noqa: SIM108 (a static choice: one of the two is compiled)
            pair = tab_scalar(pair_tab, 8 * g + r)
        else:
            pair = gl.load(sorted_pair_ptr + slot0 + r)
        row = (pair < num_pairs).to(gl.int32) * (pair // a_row_div)
        tma.async_copy_global_to_shared(x_d, [row, k * 128], bar, x_slot.slice(r, 1))


@gluon.jit
def gate_up_copies(g_d, gs_d, u_d, us_d, run, i, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                   ids, tag, STAGES: gl.constexpr, H: gl.constexpr, x_d, x_buf, sorted_pair_ptr,
                   slot0, num_pairs, a_row_div, pair_tab=None, g=0, gdc_step=-1,
                   SELF: gl.constexpr = False):
    """The producer's TMA copies of a gate/up item: run `run` (128 gate and up rows) K-step by
    K-step with the part's x rows into ring slots i, i + 1, ... (`x_buf` [STAGES, 8, 128]),
    each tagged `tag`; returns the ring position after it. `SELF` (`_nvfp4_self_route`): the x
    rows' pairs from `pair_tab` (item g of the program), and after K-step `gdc_step`'s copies
    the producer waits for the previous launch (the alignment) and lets the next one launch."""
    for k in range(H // 128):
        s = i % STAGES
        wait_slot(empty, i, STAGES)
        _tag_slot(ids, s, tag)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * g_d.block_type.nbytes + 2 * gs_d.block_type.nbytes
                        + 8 * x_d.block_type.nbytes)
        _x_copies(x_d, x_buf.index(s), bar, sorted_pair_ptr, slot0, num_pairs, a_row_div,
                  k, pair_tab, g, SELF)
        # chunk k of the run at byte run * 128 * H/2 + k * 8192 (128-byte rows); its codes at
        # byte run * 128 * H/16 + k * 1024
        tma.async_copy_global_to_shared(g_d, [run * (H // 2) + k * 64, 0], bar, g_buf.index(s))
        tma.async_copy_global_to_shared(u_d, [run * (H // 2) + k * 64, 0], bar, u_buf.index(s))
        tma.async_copy_global_to_shared(gs_d, [run * (H // 16) + k * 8, 0], bar,
                                        gs_buf.index(s))
        tma.async_copy_global_to_shared(us_d, [run * (H // 16) + k * 8, 0], bar,
                                        us_buf.index(s))
        if SELF:  # noqa: SIM102 (a static condition around a runtime one)
            if k == gdc_step:
                gdc_wait()
                gdc_launch_dependents()
        i += 1
    return i


@gluon.jit
def gate_up_item(sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_pairs,
                 stride_h, slot0, tile, expert, i, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                 x_buf, STAGES: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                 rows_tab=None, g=0, SELF: gl.constexpr = False):
    """h rows slot0..slot0+7, columns tile * 128 + [0, 128) (even columns first), from the x
    rows in the ring (`x_buf`), then one count on the routing block's counter. Returns the ring
    position after the item. `SELF` (no alignment launched): the part's pairs from row g of
    `rows_tab` (`_nvfp4_self_route`'s table), which an item of N-tile 0 also writes into the
    alignment's `sorted_pair` (before its count: the down kernel reads them once it has
    acquired the part's counts)."""
    alpha_g = gl.load(gate_alpha_ptr + expert) * 128.0  # * 2^7: the decode's 2^-7
    alpha_u = gl.load(up_alpha_ptr + expert) * 128.0
    if SELF:
        pairs = rows_tab.index(g).load(gl.SliceLayout(0, MMA))
    else:
        pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)))
    acc_g = gl.zeros([128, 8], gl.float32, MMA)
    acc_u = gl.zeros([128, 8], gl.float32, MMA)
    for _ in range(H // 128):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        g_words, g_codes = _chunk(g_buf.index(s), gs_buf.index(s))
        u_words, u_codes = _chunk(u_buf.index(s), us_buf.index(s))
        x = x_buf.index(s).load(X_L)
        release_slot(empty, s)
        x_even, x_odd = x_operands(x)
        acc_g = _mma_chunk(g_words, g_codes, x_even, x_odd, acc_g)
        acc_u = _mma_chunk(u_words, u_codes, x_even, x_odd, acc_u)
        i += 1
    g = acc_g * alpha_g
    u = acc_u * alpha_u
    h = (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(gl.bfloat16)  # tl.sigmoid's formula
    n = gl.arange(0, 128, gl.SliceLayout(1, MMA))
    cols = tile * 128 + (n % 2) * 64 + n // 2  # even columns first (what down reads)
    _store_tile(h_ptr, slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)), stride_h, cols, h,
                pairs < num_pairs)
    if SELF:  # noqa: SIM102 (a static condition around a runtime one)
        if tile == 0:
            gl.store(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)), pairs)
    gl.thread_barrier()  # every consumer thread's stores, then one release count
    gl.atomic_add(count_ptr + slot0 // BLOCK_M, 1, sem="release", scope="gpu")
    return i
