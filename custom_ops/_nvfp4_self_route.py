"""The Gluon gate/up launch's own routing: each program works out its items' experts and pairs
from `topk_ids` instead of waiting for `moe_align`'s output.

Under PDL the gate/up launch (`_nvfp4_gate_up_gluon`, items by program) starts together with
the alignment, one program, which it would otherwise wait for (`griddepcontrol.wait`) before
its first copy. Here each program first computes, for its own items (p, p + grid, ..., at most
`G`), what `moe_align.align_pairs` puts there: the experts' pair counts (`gl.histogram`), their
blocks of `BLOCK_M` slots in expert order (a scan), the block of item p's part and its expert,
and the part's 8 pairs (the expert's pairs in pair order, the `part`-th 8 of its block; padding
`num_pairs`), into three small shared tables. The producer copies the first `STAGES` K-steps of
its first item, then waits for the previous launch (so that the down kernel, which it then
lets launch, reads a finished alignment, and this launch finishes after it) and goes on; the
consumers read the pairs from the tables, never the alignment. The layout is the alignment's
by construction (GPU tests: bit for bit). Where the op launches no alignment at all, the
gate/up launch comes first and the down kernel routes its items too
(`_nvfp4_down_self_route`).

Limits: at most `MAX_PAIRS` pairs and `MAX_EXPERTS` experts (the tiles live in the registers of
four warps before the warp-specialized part); larger routings wait for the alignment.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dlmc.custom_ops._nvfp4_gate_up_items import gate_up_copies
from dlmc.custom_ops._nvfp4_gluon_parts import (
    _end_tickets,
    _place,
    gdc_launch_dependents,
    gdc_wait,
    tab_scalar,
)
from dlmc.custom_ops._nvfp4_shared_items import shared_gate_up_copies

__all__ = ["MAX_EXPERTS", "MAX_PAIRS", "route_tables", "self_producer", "self_route",
           "self_route_fits", "table_pads"]

MAX_PAIRS, MAX_EXPERTS = 512, 512

_TABLE = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # rank-1 rows, as ring tags


def table_pads(num_pairs: int, num_experts: int) -> dict[str, int]:
    """The self-routing kernels' `PAIRS_PAD` and `EXPERTS_PAD` constexprs: powers of two, at
    least 16, holding `num_pairs` pairs and `num_experts` experts (this module's and
    `_nvfp4_down_self_route`'s register tiles)."""
    return {"PAIRS_PAD": max(16, 1 << (num_pairs - 1).bit_length()),
            "EXPERTS_PAD": max(16, 1 << (num_experts - 1).bit_length())}


def self_route_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether a routing of `num_pairs` pairs over `num_experts` experts takes this path."""
    return 0 < num_pairs <= MAX_PAIRS and num_experts <= MAX_EXPERTS


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _rows(n: int) -> int:
    """Table rows for n items: a power of two (shared memory views need one)."""
    return 1 << (n - 1).bit_length()


@gluon.jit
def route_tables(G: gl.constexpr):
    """The tables of a program's `G` items (rows padded to a power of two): expert (-1: no
    work) `[G, 1]`, the part's pairs one per row `[8 G, 1]` (the producer's scalar reads) and
    by item `[G, 8]` (the consumers')."""
    ROWS: gl.constexpr = _rows(G)
    experts = gl.allocate_shared_memory(gl.int32, [ROWS, 1], _TABLE)
    pairs = gl.allocate_shared_memory(gl.int32, [8 * ROWS, 1], _TABLE)
    rows = gl.allocate_shared_memory(gl.int32, [ROWS, 8], _TABLE)
    return experts, pairs, rows


@gluon.jit
def self_route(ids_ptr, num_pairs, num_items, experts_tab, pairs_tab, rows_tab,
               G: gl.constexpr, TILES: gl.constexpr, BLOCK_M: gl.constexpr,
               PAIRS_PAD: gl.constexpr, EXPERTS_PAD: gl.constexpr, routed_grid):
    """Fill the tables (`route_tables`) for items p + g * routed_grid, g < G (an 8-slot part
    of a routing block and one of `TILES` N-tiles, `_nvfp4_gluon_parts._place`) of the routing
    `ids` (int32 or int64, `num_pairs` of them) that `moe_align` makes at `BLOCK_M`; programs
    from `routed_grid` on take none (`_nvfp4_shared_items`); four warps, before the
    warp-specialized part."""
    line: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    grid2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    PARTS: gl.constexpr = BLOCK_M // 8
    pair = gl.arange(0, PAIRS_PAD, line)
    is_pair = pair < num_pairs
    ids = gl.load(ids_ptr + pair, mask=is_pair, other=0).to(gl.int32)
    counts = gl.histogram(ids, EXPERTS_PAD, mask=is_pair, layout=line)  # [E]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = gl.associative_scan(blocks, 0, _add)
    block_start = block_end - blocks
    used = gl.sum(blocks, axis=0)
    experts = gl.arange(0, EXPERTS_PAD, line)
    pair2 = gl.expand_dims(gl.convert_layout(pair, gl.SliceLayout(0, grid2)), 0)  # [1, P]
    r = gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(1, grid2)), 1)  # [8, 1]
    for g in gl.static_range(G):
        item = gl.program_id(0) + g * routed_grid
        block = item // (PARTS * TILES)
        # the expert whose blocks hold `block`: the experts whose blocks end at or before it
        expert = gl.sum((block_end <= block).to(gl.int32), axis=0)
        mine = experts == expert
        first = ((block - gl.sum(gl.where(mine, block_start, 0), axis=0)) * BLOCK_M
                 + ((item // TILES) % PARTS) * 8)  # the part's first rank in the expert
        count = gl.sum(gl.where(mine, counts, 0), axis=0)
        work = ((item < num_items) & (block < used) & (first < count)
                & (gl.program_id(0) < routed_grid))
        experts_tab.index(g).store(gl.full([1], gl.where(work, expert, -1), gl.int32, line))
        if work:  # (the part's pairs: unread for an item without work)
            taken = is_pair & (ids == expert)
            rank = gl.associative_scan(taken.to(gl.int32), 0, _add) - 1  # [P] rank in expert
            hit = (gl.expand_dims(gl.convert_layout(taken, gl.SliceLayout(0, grid2)), 0)
                   & (gl.expand_dims(gl.convert_layout(rank, gl.SliceLayout(0, grid2)), 0)
                      == first + r))  # [8, P]
            found = gl.sum(hit.to(gl.int32), axis=1)
            pairs = gl.where(found > 0, gl.sum(gl.where(hit, pair2, 0), axis=1), num_pairs)
            rows_tab.index(g).store(pairs)
            pairs_tab._reinterpret(gl.int32, [8 * _rows(G)], _TABLE).slice(8 * g, 8).store(
                gl.convert_layout(pairs, line))


@gluon.jit
def self_producer(g_d, gs_d, u_d, us_d, x_d, num_pairs, a_row_div, empty, ready, g_buf,
                  gs_buf, u_buf, us_buf, x_buf, ids, experts_tab, pairs_tab,
                  G: gl.constexpr, STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                  BLOCK_M: gl.constexpr, routed_grid, sg_d=None, su_d=None, xs_d=None,
                  h_buf=None, SHARED_ITEMS: gl.constexpr = False):
    """The gate/up items alone by program (p, p + routed_grid, ...), their experts and pairs
    from the program's own tables (`self_route`): after the first `STAGES` K-steps of its
    first item (at once if it has none) this warp waits for the previous launch and lets the
    next one launch. `SHARED_ITEMS`: program `routed_grid + j` then runs shared item j
    (`_nvfp4_shared_items`: the descriptors `sg_d`, `su_d`, `xs_d`; x in `h_buf`)."""
    GDC_STEP: gl.constexpr = min(STAGES, H // 128) - 1
    i = 0  # ring slots filled so far
    for g in range(G):
        expert = tab_scalar(experts_tab, g)
        if expert >= 0:
            item = gl.program_id(0) + g * routed_grid
            slot0, tile = _place(item, I // 128, BLOCK_M)
            i = gate_up_copies(g_d, gs_d, u_d, us_d, expert * (I // 128) + tile, i, empty,
                               ready, g_buf, gs_buf, u_buf, us_buf, ids, item * 1024 + expert,
                               STAGES, H, x_d, x_buf, x_d, slot0, num_pairs, a_row_div,
                               pairs_tab, g, gl.where(g == 0, GDC_STEP, -1), True)
        elif g == 0:
            gdc_wait()
            gdc_launch_dependents()
    if SHARED_ITEMS:  # noqa: SIM102 (a static condition around a runtime one)
        if gl.program_id(0) >= routed_grid:
            i = shared_gate_up_copies(sg_d, su_d, xs_d, gl.program_id(0) - routed_grid, i,
                                      empty, ready, g_buf, u_buf, h_buf, ids, STAGES, H)
    _end_tickets(ids, 0, 0, ids, empty, ready, i, STAGES, False)
