"""`dlmc::nvfp4_moe`'s routed experts (gate/up with SiLU-mul, then down) in one persistent,
warp-specialized Gluon kernel (`DLMC_NVFP4_DOWN=fused`, sm_90, kernel v7's stored forms).

Work items: first every gate/up item (an 8-slot part of a routing block, a 128-row N-tile of
I), then every down item (the same parts, 128-row N-tiles of H); program p walks items p, p +
grid, ... in order (`TICKETS`: each producer takes the next unclaimed item from a counter
instead, which balances the programs; off). The producer warp skips the items without work
(parts whose first slot is padding, unused blocks) and fills a ring with TMA copies, each slot
tagged with its item and expert (`item * 1024 + expert`; -1 ends the consumers' loop), so the
consumers see only real work. A gate/up ring slot is one K-step: the gate and up chunks (8 KB
each) and their codes (1 KB each). A down slot is two K-steps of the down weights in the same
buffers plus the part's h rows (four 1 KB halves): before copying h for a down item the
producer spins until the routing block's gate/up items have counted themselves done
(`moe_overlap`'s counters, release / acquire, then a proxy fence for TMA), while that slot's
weights are already in flight. The consumer warps decode the words with v7's asm and multiply
them as the MMA's A operand with the part's 8 slots as B (`_nvfp4_down_gluon`); gate/up reads
the part's x rows (gathered per token), stores h (bf16, each 128 columns even first) and counts
itself done. Every program's gate/up items come before its down items, so a spin waits only for
work that waits for nothing, provided every program is resident at once: the grid is at most
what fits (`programs_per_sm` and the driver's occupancy calculator; Gluon pads the five warps
to 256 threads).

As one launch this kernel was slower than separate gate/up and down launches (sessions 25-26,
perf/README.md). `launch_moe_gluon(gate_up_only=True)` (`DLMC_NVFP4_GATE_UP=gluon`, the default
where `gate_up_applies`) runs the gate/up items alone, by program, before the Gluon down kernel
(`_nvfp4_down_gluon`, which then waits for `I / 128` counts per 8-slot part; session 27).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_self_route
from dlmc.custom_ops._nvfp4_gate_up_gluon import (
    _gate_up_item,
    gate_up_copies,
    x_layout,
    x_ring,
)
from dlmc.custom_ops._nvfp4_gluon_parts import (
    H_OP,
    MMA,
    TAGS,
    _chunk,
    _end_tickets,
    _fence_proxy_async_global,
    _item,
    _mma_chunk,
    _place,
    _store_tile,
    _tag,
    _tag_slot,
    _wait_rows,
    check_item_tags,
    chunk_rings,
    gdc_launch_dependents,
    gdc_wait,
    ring_barriers,
    shared_layouts,
)
from dlmc.custom_ops._nvfp4_gluon_ring import release_slot, wait_slot
from dlmc.custom_ops._nvfp4_self_route import (
    route_tables,
    self_producer,
    self_route,
    self_route_fits,
    table_pads,
)
from dlmc.custom_ops._nvfp4_shared_items import (
    SHARED_TAG,
    gate_up_item_options,
    gate_up_programs,
    shared_gate_up_item,
)
from dlmc.custom_ops._occupancy import resident_programs

__all__ = ["fused_applies", "gate_up_applies", "launch_moe_gluon", "programs_per_sm",
           "self_routes"]

# ring depth, programs per SM (at most what fits: `programs_per_sm`), registers per thread (80:
# no spills in sm_90 SASS, and 3 programs of 256 threads fit in an SM's 64 K registers); the
# gate/up prototype's best was the same (perf/README.md, session 25)
STAGES, PROGRAMS_PER_SM, MAXNREG = 3, 3, 80
# 0: items by program; 1: every item by a ticket counter; 2: gate/up items by program, then
# down items by ticket (session 27: 0 fastest)
TICKETS = 0
X_TMA = True  # gate/up items' x rows copied into the ring by the producer (else loaded by the
# consumer warps from global memory)
# a ring slot: two weight chunks and their codes, (down items) four 1 KB halves of h rows, and
# (gate/up items, `X_TMA`) the part's 8 x rows of the K-step (2 KB)
STAGE_BYTES = 2 * 8192 + 2 * 1024 + 4 * 1024 + 2048
THREADS = 8 * 32  # four consumer warps and the producer warp, padded to two warpgroups
_PROGRAMS: dict[tuple, int] = {}  # the grid (resident programs), per device and kernel form


@gluon.jit
def _down_copies(d_d, ds_d, h_d, count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0, run,
                 i, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, ids, tag,
                 STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                 BLOCK_M: gl.constexpr):
    """The producer's copies of a down item, two K-steps per ring slot: the weight chunks and
    codes first; then (first slot) a spin until the routing block's gate/up items have stored
    its h rows (`_wait_rows`: this warp counts as the item's reader) and a proxy fence, so
    that TMA reads those rows; then the part's h rows of both K-steps (even and odd halves)."""
    for j in gl.static_range(I // 256):
        s = i % STAGES
        wait_slot(empty, i, STAGES)
        _tag_slot(ids, s, tag)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * d_d.block_type.nbytes + 2 * ds_d.block_type.nbytes
                        + 4 * h_d.block_type.nbytes)
        tma.async_copy_global_to_shared(d_d, [run * (I // 2) + 2 * j * 64, 0], bar,
                                        g_buf.index(s))
        tma.async_copy_global_to_shared(d_d, [run * (I // 2) + 2 * j * 64 + 64, 0], bar,
                                        u_buf.index(s))
        tma.async_copy_global_to_shared(ds_d, [run * (I // 16) + 2 * j * 8, 0], bar,
                                        gs_buf.index(s))
        tma.async_copy_global_to_shared(ds_d, [run * (I // 16) + 2 * j * 8 + 8, 0], bar,
                                        us_buf.index(s))
        if j == 0:
            _wait_rows(count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0, I // 128,
                       H // 128, BLOCK_M, True, 1)
            _fence_proxy_async_global()
        for q in gl.static_range(4):  # K-step 2j + q // 2, half q % 2
            tma.async_copy_global_to_shared(h_d, [slot0, (2 * j + q // 2) * 128 + (q % 2) * 64],
                                            bar, h_buf.index(4 * s + q))
        i += 1
    return i


@gluon.jit
def _producer(g_d, gs_d, u_d, us_d, d_d, ds_d, h_d, x_d, expert_of_block_ptr, sorted_pair_ptr,
              count_ptr, num_slots, gate_up_items, down_items, num_pairs, shared_id, a_row_div,
              empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, x_buf, ids,
              STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr, BLOCK_M: gl.constexpr,
              TICKETS: gl.constexpr, X_TMA: gl.constexpr):
    """Walks its items (`TICKETS` 1: the next unclaimed item from the ticket counter after the
    block counters, taken one item ahead; 0: program p's items p, p + grid, ...; 2: the
    gate/up items by program, then down items by ticket), skips those without work, and fills
    the ring for the rest, each slot tagged with its item; a last slot tagged -1 ends the
    consumers' loop. The program whose ticket is the launch's last zeroes the ticket
    counter."""
    total = gate_up_items + down_items
    ticket = count_ptr + 2 * num_slots
    if TICKETS == 1:  # noqa: SIM108 (a statement: the atomic only with tickets)
        item = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    else:
        item = gl.program_id(0)
    if TICKETS == 2:  # noqa: SIM102 (a static condition around a runtime one)
        if item >= gate_up_items:  # no gate/up item for this program: a down ticket
            item = gate_up_items + gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    i = 0  # ring slots filled so far
    while item < total:
        if TICKETS == 1:
            after = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")  # read after the copies
        elif TICKETS == 2:
            after = item + gl.num_programs(0)
            if after >= gate_up_items:  # the next down item, by ticket
                after = gate_up_items + gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
        else:
            after = item + gl.num_programs(0)
        if item < gate_up_items:
            slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                                  gate_up_items, num_pairs, shared_id,
                                                  I // 128, BLOCK_M)
            if has_work:
                i = gate_up_copies(g_d, gs_d, u_d, us_d, expert * (I // 128) + tile, i, empty,
                                   ready, g_buf, gs_buf, u_buf, us_buf, ids,
                                   item * 1024 + expert, STAGES, H, x_d, x_buf,
                                   sorted_pair_ptr, slot0, num_pairs, a_row_div, X_TMA)
        else:
            slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr,
                                                  item - gate_up_items, down_items, num_pairs,
                                                  shared_id, H // 128, BLOCK_M)
            if has_work:
                i = _down_copies(d_d, ds_d, h_d, count_ptr, num_slots, sorted_pair_ptr,
                                 num_pairs, slot0, expert * (H // 128) + tile, i, empty, ready,
                                 g_buf, gs_buf, u_buf, us_buf, h_buf, ids,
                                 item * 1024 + expert, STAGES, H, I, BLOCK_M)
        item = after
    _end_tickets(ticket, item, total, ids, empty, ready, i, STAGES, TICKETS)


@gluon.jit
def _any_producer(g_d, gs_d, u_d, us_d, d_d, ds_d, h_d, x_d, expert_of_block_ptr,
                  sorted_pair_ptr, count_ptr, num_slots, gate_up_items, down_items, num_pairs,
                  shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, x_buf,
                  ids, experts_tab, pairs_tab, STAGES: gl.constexpr, H: gl.constexpr,
                  I: gl.constexpr, BLOCK_M: gl.constexpr, TICKETS: gl.constexpr,
                  X_TMA: gl.constexpr, SELF: gl.constexpr, G: gl.constexpr, routed_grid,
                  sg_d, su_d, xs_d, SHARED_ITEMS: gl.constexpr):
    """The producer warp: `_nvfp4_self_route.self_producer` with `SELF`, else `_producer`."""
    if SELF:
        self_producer(g_d, gs_d, u_d, us_d, x_d, num_pairs, a_row_div, empty, ready, g_buf,
                       gs_buf, u_buf, us_buf, x_buf, ids, experts_tab, pairs_tab, G, STAGES, H,
                       I, BLOCK_M, routed_grid, sg_d, su_d, xs_d, h_buf, SHARED_ITEMS)
    else:
        _producer(g_d, gs_d, u_d, us_d, d_d, ds_d, h_d, x_d, expert_of_block_ptr,
                  sorted_pair_ptr, count_ptr, num_slots, gate_up_items, down_items, num_pairs,
                  shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf,
                  x_buf, ids, STAGES, H, I, BLOCK_M, TICKETS, X_TMA)


@gluon.jit
def _down_item(sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, slot0, tile, expert, i,
               empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, STAGES: gl.constexpr,
               I: gl.constexpr):
    """y rows of the part's pairs, columns tile * 128 + [0, 128), from the ring (weights,
    codes and the part's h rows, two K-steps per slot). Returns the ring position after it."""
    alpha = gl.load(alpha_ptr + expert) * 128.0
    pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)))
    acc = gl.zeros([128, 8], gl.float32, MMA)
    for _ in gl.static_range(I // 256):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        for step in gl.static_range(2):  # K-steps 2j (gate buffers) and 2j + 1 (up buffers)
            if step == 0:
                words, codes = _chunk(g_buf.index(s), gs_buf.index(s))
            else:
                words, codes = _chunk(u_buf.index(s), us_buf.index(s))
            h_even = h_buf.index(4 * s + 2 * step).permute([1, 0]).load(H_OP)
            h_odd = h_buf.index(4 * s + 2 * step + 1).permute([1, 0]).load(H_OP)
            if step == 1:
                release_slot(empty, s)
            acc = _mma_chunk(words, codes, h_even, h_odd, acc)
        i += 1
    cols = tile * 128 + gl.arange(0, 128, gl.SliceLayout(1, MMA))
    _store_tile(y_ptr, pairs, stride_y, cols, (acc * alpha).to(gl.bfloat16), pairs < num_pairs)
    return i


@gluon.jit
def _run_item(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, down_alpha_ptr, h_ptr, y_ptr,
              count_ptr, gate_up_items, num_pairs, stride_x, stride_h, stride_y, a_row_div,
              empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, x_buf, rows_tab, item, expert,
              i, routed_grid, STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
              BLOCK_M: gl.constexpr, X_TMA: gl.constexpr, SELF: gl.constexpr,
              PAIRS_OUT: gl.constexpr):
    """One routed item of `_consumer` (gate/up, or down); returns the ring position after it."""
    if item < gate_up_items:
        slot0, tile = _place(item, I // 128, BLOCK_M)
        g = (item - gl.program_id(0)) // routed_grid  # (`SELF`: its table row)
        i = _gate_up_item(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                          count_ptr, num_pairs, stride_x, stride_h, a_row_div, slot0, tile,
                          expert, i, empty, ready, g_buf, gs_buf, u_buf, us_buf, STAGES, H,
                          BLOCK_M, True, x_buf, X_TMA, 4, rows_tab, g, SELF, PAIRS_OUT)
    else:
        slot0, tile = _place(item - gate_up_items, H // 128, BLOCK_M)
        i = _down_item(sorted_pair_ptr, down_alpha_ptr, y_ptr, num_pairs, stride_y, slot0,
                       tile, expert, i, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf,
                       STAGES, I)
    return i


@gluon.jit
def _consumer(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, down_alpha_ptr, h_ptr,
              y_ptr, count_ptr, gate_up_items, num_pairs, stride_x, stride_h, stride_y,
              a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, x_buf, ids,
              rows_tab, STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
              BLOCK_M: gl.constexpr, X_TMA: gl.constexpr, SELF: gl.constexpr,
              PAIRS_OUT: gl.constexpr = False, routed_grid=1, shared_slot=0, h_row0=0,
              num_tokens=0, SHARED_ITEMS: gl.constexpr = False):
    """Runs the items the producer tagged, in its order, until the tag -1 (`SELF`: the
    gate/up items' pairs from the program's table, row (item - p) / routed_grid; `PAIRS_OUT`:
    written into `sorted_pair` too, `_gate_up_item`; `SHARED_ITEMS`: the shared expert's
    items, `_nvfp4_shared_items`)."""
    i = 0  # ring slots consumed so far
    tag = _tag(ids, ready, i, STAGES)
    while tag >= 0:
        item, expert = tag // 1024, tag % 1024
        args = (x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, down_alpha_ptr, h_ptr,
                y_ptr, count_ptr, gate_up_items, num_pairs, stride_x, stride_h, stride_y,
                a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf, x_buf, rows_tab,
                item, expert, i, routed_grid)
        if SHARED_ITEMS:
            if expert == SHARED_TAG:
                i = shared_gate_up_item(h_ptr, count_ptr, shared_slot, h_row0, num_tokens,
                                        stride_h, item, i, empty, ready, g_buf, u_buf, h_buf,
                                        STAGES, H)
            else:
                i = _run_item(*args, STAGES, H, I, BLOCK_M, X_TMA, SELF, PAIRS_OUT)
        else:
            i = _run_item(*args, STAGES, H, I, BLOCK_M, X_TMA, SELF, PAIRS_OUT)
        tag = _tag(ids, ready, i, STAGES)


@gluon.jit
def _moe_gluon_kernel(g_d, gs_d, u_d, us_d, d_d, ds_d, h_d, x_d, x_ptr, expert_of_block_ptr,
                      sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, down_alpha_ptr, h_ptr,
                      y_ptr, count_ptr, num_slots, gate_up_items, down_items, num_pairs,
                      shared_id, stride_x, stride_h, stride_y, a_row_div,
                      STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                      BLOCK_M: gl.constexpr, PDL_ENTER: gl.constexpr = False,
                      PDL_AFTER: gl.constexpr = False, TICKETS: gl.constexpr = False,
                      X_TMA: gl.constexpr = False, ids_ptr=None, SELF: gl.constexpr = False,
                      G: gl.constexpr = 1, PAIRS_PAD: gl.constexpr = 16,
                      EXPERTS_PAD: gl.constexpr = 16, WAIT_FIRST: gl.constexpr = False,
                      routed_grid=1, sg_d=None, su_d=None, xs_d=None, shared_slot=0, h_row0=0,
                      num_tokens=0, SHARED_ITEMS: gl.constexpr = False):
    """`PDL_ENTER`: launched with PDL right after the routing (wait for it, then let the next
    kernel launch). `PDL_AFTER`: launched with PDL after the shared expert's down parts, which
    come after the routing: let the next kernel launch at once, and finish only after the
    kernel before has (the combine that follows waits for this one alone). `TICKETS` (1, or 2
    for the down items alone): items
    handed out by a counter (`count_ptr[2 * num_slots]`, zero between launches) instead of by
    program: balanced, and free of deadlock whatever number of programs is resident. `X_TMA`:
    gate/up items' x rows by the producer's TMA copies (`x_d`: x's [1, 128] boxes).
    `SELF` (gate/up items alone, by program, `X_TMA`, launched with PDL right after the
    routing, `PDL_ENTER` off): each program's `G` items routed from `ids_ptr` by the program
    itself (`_nvfp4_self_route`; `PAIRS_PAD`, `EXPERTS_PAD`: powers of two at least the pairs
    and experts); the producer waits for the routing launch after its first copies.
    `WAIT_FIRST` (with `SELF`): the op's first launch (`DLMC_NVFP4_DOWN_SELF_ROUTE`): wait for
    the kernel before (which may have written the routing) before routing, then let the next
    kernel launch (the producer's later wait returns at once); no alignment was launched, so
    the items of N-tile 0 write their parts' pairs into `sorted_pair` for the down kernel.
    `routed_grid` (with `SELF`): the programs that take routed items (p + g * routed_grid);
    `SHARED_ITEMS`: the others run the shared expert's gate/up items (`_nvfp4_shared_items`:
    `sg_d`, `su_d`, `xs_d`; h rows `h_row0 + t` for `num_tokens`, counted on
    `count_ptr[shared_slot]`)."""
    if SELF:
        if WAIT_FIRST:
            gdc_wait()
        experts_tab, pairs_tab, rows_tab = route_tables(G)
        self_route(ids_ptr, num_pairs, gate_up_items, experts_tab, pairs_tab, rows_tab, G,
                   I // 128, BLOCK_M, PAIRS_PAD, EXPERTS_PAD, routed_grid)
        if WAIT_FIRST:
            gdc_launch_dependents()
    if PDL_ENTER:
        gdc_wait()
    if PDL_ENTER or PDL_AFTER:
        gdc_launch_dependents()
    g_buf, u_buf, gs_buf, us_buf = chunk_rings(g_d, u_d, gs_d, us_d, STAGES)
    h_buf = gl.allocate_shared_memory(h_d.dtype, [4 * STAGES] + h_d.block_type.shape,
                                      h_d.layout)
    ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], TAGS)  # one tag per ring slot
    x_buf = x_ring(x_d, h_buf, STAGES, X_TMA)
    if not SELF:  # (placeholders: not read)
        experts_tab, pairs_tab, rows_tab = ids, ids, ids
    empty, ready = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, down_alpha_ptr,
                     h_ptr, y_ptr, count_ptr, gate_up_items, num_pairs, stride_x, stride_h,
                     stride_y, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, h_buf,
                     x_buf, ids, rows_tab, STAGES, H, I, BLOCK_M, X_TMA, SELF, WAIT_FIRST,
                     routed_grid, shared_slot, h_row0, num_tokens, SHARED_ITEMS)),
        (_any_producer, (g_d, gs_d, u_d, us_d, d_d, ds_d, h_d, x_d, expert_of_block_ptr,
                         sorted_pair_ptr, count_ptr, num_slots, gate_up_items, down_items,
                         num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf,
                         us_buf, h_buf, x_buf, ids, experts_tab, pairs_tab, STAGES, H, I,
                         BLOCK_M, TICKETS, X_TMA, SELF, G, routed_grid, sg_d, su_d, xs_d,
                         SHARED_ITEMS)),
    ], [1], [40])
    if PDL_AFTER:
        gdc_wait()


def self_routes(topk_ids: torch.Tensor | None, num_pairs: int, num_experts: int, pdl: str,
                gate_up_only: bool) -> bool:
    """Whether `launch_moe_gluon`'s gate/up programs route their own items
    (`_nvfp4_self_route`): handed the routing's `topk_ids`, gate/up items alone, launched with
    PDL after the alignment ("enter") or first ("first"), x rows by TMA, `DLMC_NVFP4_SELF_ROUTE`,
    and a routing within the tables' limits."""
    return (topk_ids is not None and _nvfp4_self_route.SELF_ROUTE and gate_up_only
            and pdl in ("enter", "first") and X_TMA and topk_ids.numel() == num_pairs
            and self_route_fits(num_pairs, num_experts))


def _runs(device: torch.device, variant: int, hidden: int, inter: int, emulate_w4a4: bool,
          opaque: bool, pdl: bool, num_experts: int) -> bool:
    """Kernel v7's stored forms (`variant` 7; H a multiple of 128, I of 256: a down ring slot
    holds two K-steps), no W4A4 emulation, the op registered opaque and launching with PDL
    (`moe_overlap.overlap_pdl`), fewer than 1024 experts (the ring's item tags), on a CUDA
    device of compute capability 9.0."""
    return (variant == 7 and hidden % 128 == 0 and inter % 256 == 0 and num_experts < 1024
            and not emulate_w4a4 and opaque and pdl
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def fused_applies(device: torch.device, variant: int, hidden: int, inter: int, emulate_w4a4: bool,
                  opaque: bool, pdl: bool, num_experts: int = 0) -> bool:
    """Whether `nvfp4_moe` runs its routed experts in this kernel: `DLMC_NVFP4_DOWN=fused`
    where the kernel runs (`_runs`)."""
    return _nvfp4_down_gluon.MODE == "fused" and _runs(device, variant, hidden, inter,
                                                       emulate_w4a4, opaque, pdl, num_experts)


def gate_up_applies(device: torch.device, variant: int, hidden: int, inter: int,
                    emulate_w4a4: bool, opaque: bool, pdl: bool, num_experts: int,
                    gluon_down: bool, has_shared: bool) -> bool:
    """Whether `nvfp4_moe` runs its routed gate/up projection as this kernel's gate/up items
    alone (`launch_moe_gluon(gate_up_only=True)`), before the Gluon down kernel:
    `DLMC_NVFP4_GATE_UP=gluon`, the Gluon down kernel (`gluon_down`), no shared expert in the
    routing (`has_shared`; as items it is not) and where the kernel runs (`_runs`)."""
    return (_nvfp4_down_gluon.gate_up_gluon() and gluon_down and not has_shared
            and _runs(device, variant, hidden, inter, emulate_w4a4, opaque, pdl, num_experts))


def programs_per_sm(device: torch.device, stages: int = STAGES, per_sm: int = PROGRAMS_PER_SM,
                    maxnreg: int = MAXNREG) -> int:
    """`per_sm`, capped at the programs that fit on one SM together (shared memory: the ring,
    1 KB for barriers, 1 KB the driver reserves; registers: `maxnreg` for each of `THREADS`).
    The grid must fit at once: a program's down items wait for other programs' gate/up items
    (session 25: 3 programs of 256 threads at 96 registers did not fit, and the kernel hung).
    The launch also asks the driver's occupancy calculator (`_occupancy`)."""
    props = torch.cuda.get_device_properties(device)  # (sm_90 values if torch lacks a field)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (
        stages * STAGE_BYTES + 2048)
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (maxnreg * THREADS)
    return max(1, min(per_sm, by_smem, by_regs))


def _descriptors(words: torch.Tensor, codes: torch.Tensor) -> tuple[object, object]:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w_l, s_l, _ = shared_layouts()
    return (TensorDescriptor.from_tensor(words.view(torch.uint8).view(-1, 128), [64, 128], w_l),
            TensorDescriptor.from_tensor(codes.view(torch.uint8).view(torch.int32).view(-1, 32),
                                         [8, 32], s_l))


def launch_moe_gluon(x: torch.Tensor, sorted_pair: torch.Tensor, expert_of_block: torch.Tensor,
                     weights: tuple[torch.Tensor, ...], alphas: tuple[torch.Tensor, ...],
                     h: torch.Tensor, y: torch.Tensor, count: torch.Tensor, num_slots: int,
                     num_pairs: int, shared_id: int, a_row_div: int, pdl: str = "",
                     gate_up_only: bool = False, topk_ids: torch.Tensor | None = None,
                     shared_items: tuple | None = None) -> None:
    """h[slot] = silu(x @ gate^T) * (x @ up^T) (even-odd columns) and y[pair] = h @ down^T for
    the routed pairs of the routing (`sorted_pair`, `expert_of_block`: 16-, 32- or 64-slot
    blocks; blocks of expert `shared_id` skipped). x bf16 `[rows, H]` (pair p reads row
    p // `a_row_div`); `weights`: gate, gate codes, up, up codes, down, down codes (v7's
    stored forms, viewed as bytes); `alphas`: fp32 `[E]` gate, up, down; h bf16 `[S, I]`,
    y bf16 `[P, H]`; `count`: `moe_overlap.counters` for `num_slots` slots and the ticket
    counter after them (`2 * num_slots + 1` entries, zero; left zero).
    `pdl`: "" (plain launch), "enter" (PDL after the routing), "after" (PDL after the shared
    expert's down parts), "first" (the op's first launch, self-routed: `self_routes` must hold;
    its programs wait for the kernel before, route themselves, then let the down kernel
    launch, which routes itself too: `DLMC_NVFP4_DOWN_SELF_ROUTE`).
    `gate_up_only`: h alone, items by program (the Gluon down kernel that follows takes the
    ticket counter; it waits for each 8-slot part's `I / 128` counts).
    `topk_ids` (`[T, K]` of the routing that `sorted_pair` aligns, `shared_id` experts): where
    `self_routes`, each program routes its own items (`_nvfp4_self_route`) instead of waiting
    for the alignment launch (or, "first", instead of reading an alignment made before).
    `shared_items` (self-routed): `_nvfp4_shared_items`' items, run by the last
    `gate_up_programs(I)` programs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    H, I = x.shape[1], h.shape[1]
    descs = [d for words, codes in zip(weights[::2], weights[1::2], strict=True)
             for d in _descriptors(words, codes)]
    descs.append(TensorDescriptor.from_tensor(h, [8, 64], shared_layouts()[2]))
    descs.append(TensorDescriptor.from_tensor(x, [1, 128], x_layout()))
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    parts = expert_of_block.shape[0] * (block_m // 8)
    gate_up_items = parts * (I // 128)
    down_items = 0 if gate_up_only else parts * (H // 128)
    check_item_tags(gate_up_items + down_items, shared_id, "the fused Gluon kernel")
    args = (*descs, x, expert_of_block, sorted_pair, *alphas, h, y, count, num_slots,
            gate_up_items, down_items, num_pairs, shared_id, x.stride(0),
            h.stride(0), y.stride(0), a_row_div)
    tickets = 0 if gate_up_only else int(TICKETS)
    routed = self_routes(topk_ids, num_pairs, shared_id, pdl, gate_up_only)
    if pdl == "first" and not routed:
        raise ValueError("launch_moe_gluon: pdl='first' needs a self-routed gate/up launch "
                         "(`self_routes`)")
    options = {"STAGES": STAGES, "H": H, "I": I, "BLOCK_M": block_m,
               "PDL_ENTER": pdl == "enter" and not routed, "PDL_AFTER": pdl == "after",
               "TICKETS": tickets, "X_TMA": X_TMA, "num_warps": 4, "maxnreg": MAXNREG,
               "WAIT_FIRST": pdl == "first", **({"launch_pdl": True} if pdl else {})}
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    shared_n = 0 if shared_items is None else gate_up_programs(I)  # programs of shared items
    if routed:
        options |= {"ids_ptr": topk_ids.reshape(-1), "SELF": True,
                    **table_pads(num_pairs, shared_id),
                    "routed_grid": sms * programs_per_sm(x.device) - shared_n}
        options["G"] = -(-gate_up_items // options["routed_grid"])
    if shared_items is not None:
        if not routed:
            raise ValueError("launch_moe_gluon: shared items need a self-routed launch")
        options |= gate_up_item_options(shared_items, x)
    key = (x.device, STAGES, PROGRAMS_PER_SM, MAXNREG, tickets, X_TMA, H, I, block_m, pdl,
           routed, shared_n)
    if count.numel() < 2 * num_slots + 1:
        raise ValueError(f"nvfp4_moe: the fused Gluon kernel needs {2 * num_slots + 1} counters "
                         f"(`moe_overlap.counters(device, num_slots + 1)`), got {count.numel()}")
    if key not in _PROGRAMS:  # compiled (not launched) once per form: what fits at once
        compiled = _moe_gluon_kernel.warmup(*args, grid=(1,), **options)
        fit = min(programs_per_sm(x.device, STAGES, PROGRAMS_PER_SM, MAXNREG),
                  resident_programs(compiled, 32 * compiled.metadata.num_warps))
        if fit < 1:
            raise RuntimeError(f"nvfp4_moe: the fused Gluon kernel (STAGES={STAGES}, "
                               f"MAXNREG={MAXNREG}) does not fit on an SM of {x.device}")
        _PROGRAMS[key] = fit * sms
    if routed:  # each program's items: p, p + routed_grid, ...
        routed_grid = _PROGRAMS[key] - shared_n
        options |= {"G": -(-gate_up_items // routed_grid), "routed_grid": routed_grid}
    _moe_gluon_kernel[(_PROGRAMS[key],)](*args, **options)
