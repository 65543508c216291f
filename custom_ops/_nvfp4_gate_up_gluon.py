"""`dlmc::nvfp4_moe`'s routed gate/up projection (with SiLU-mul) as a persistent,
warp-specialized Gluon kernel (sm_90, kernel v7's stored forms), launched before the Gluon down
kernel (`_nvfp4_down_gluon`).

Work items: an 8-slot part of a routing block and a 128-row N-tile of I
(`_nvfp4_gate_up_items`); program p walks items p, p + grid, ... in order. The producer warp
skips the items without work (parts whose first slot is padding, unused blocks) and fills a
ring with TMA copies (the gate and up chunks, their codes and the part's x rows), each slot
tagged with its item and expert (`item * 1024 + expert`; -1 ends the consumers' loop), so the
consumers see only real work. The consumer warps decode the words with v7's asm, multiply them
as the MMA's A operand with the part's 8 x rows as B, store h (bf16, each 128 columns even
first: what the down kernel reads) and count the item done on its routing block's counter
(`moe_overlap`); the down kernel waits for `I / 128` counts per 8-slot part.

Launched with PDL, after the alignment; or, where the routing fits (`self_routes`), as the op's
first launch, no alignment made: each program waits for the kernel before, routes its own items
from `topk_ids` (`_nvfp4_self_route`), then lets the down kernel launch, and the items of
N-tile 0 write their parts' pairs into `sorted_pair` for it. The last programs of the grid may
then run the BF16 shared expert's items (`_nvfp4_shared_items`). The grid is what fits at once
(`programs_per_sm` and the driver's occupancy calculator; Gluon pads the five warps to 256
threads). Design: docs/nvfp4.md §3.2.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dlmc.custom_ops import _nvfp4_self_route
from dlmc.custom_ops._nvfp4_gate_up_items import gate_up_copies, gate_up_item, x_layout
from dlmc.custom_ops._nvfp4_gluon_parts import (
    TAGS,
    _end_tickets,
    _item,
    _place,
    _tag,
    check_item_tags,
    chunk_rings,
    gdc_launch_dependents,
    gdc_wait,
    ring_barriers,
    shared_layouts,
)
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

__all__ = ["gate_up_gluon_applies", "launch_gate_up_gluon", "programs_per_sm", "self_routes"]

# ring depth, programs per SM (at most what fits: `programs_per_sm`), registers per thread (80:
# no spills in sm_90 SASS, and 3 programs of 256 threads fit in an SM's 64 K registers)
STAGES, PROGRAMS_PER_SM, MAXNREG = 3, 3, 80
# a ring slot: two weight chunks and their codes, four 1 KB boxes (`xs_buf`: the shared items'
# x tile, bf16 [32, 64]) and the part's 8 x rows of the K-step (2 KB)
STAGE_BYTES = 2 * 8192 + 2 * 1024 + 4 * 1024 + 2048
THREADS = 8 * 32  # four consumer warps and the producer warp, padded to two warpgroups
XS_BOX = gl.constexpr(shared_layouts()[2])  # `xs_buf`'s bf16 [8, 64] boxes (h's TMA box)
_PROGRAMS: dict[tuple, int] = {}  # the grid (resident programs), per device and kernel form


@gluon.jit
def _producer(g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
              num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, x_buf,
              ids, STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
              BLOCK_M: gl.constexpr):
    """Walks program p's items p, p + grid, ... of the alignment, skips those without work,
    and fills the ring for the rest, each slot tagged with its item; a last slot tagged -1
    ends the consumers' loop."""
    item = gl.program_id(0)
    i = 0  # ring slots filled so far
    while item < num_items:
        after = item + gl.num_programs(0)
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, I // 128, BLOCK_M)
        if has_work:
            i = gate_up_copies(g_d, gs_d, u_d, us_d, expert * (I // 128) + tile, i, empty,
                               ready, g_buf, gs_buf, u_buf, us_buf, ids, item * 1024 + expert,
                               STAGES, H, x_d, x_buf, sorted_pair_ptr, slot0, num_pairs,
                               a_row_div)
        item = after
    _end_tickets(ids, item, num_items, ids, empty, ready, i, STAGES, False)


@gluon.jit
def _any_producer(g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
                  num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                  xs_buf, x_buf, ids, experts_tab, pairs_tab, STAGES: gl.constexpr,
                  H: gl.constexpr, I: gl.constexpr, BLOCK_M: gl.constexpr, SELF: gl.constexpr,
                  G: gl.constexpr, routed_grid, sg_d, su_d, xs_d, SHARED_ITEMS: gl.constexpr):
    """The producer warp: `_nvfp4_self_route.self_producer` with `SELF`, else `_producer`."""
    if SELF:
        self_producer(g_d, gs_d, u_d, us_d, x_d, num_pairs, a_row_div, empty, ready, g_buf,
                      gs_buf, u_buf, us_buf, x_buf, ids, experts_tab, pairs_tab, G, STAGES, H,
                      I, BLOCK_M, routed_grid, sg_d, su_d, xs_d, xs_buf, SHARED_ITEMS)
    else:
        _producer(g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
                  num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                  x_buf, ids, STAGES, H, I, BLOCK_M)


@gluon.jit
def _routed_item(sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_pairs,
                 stride_h, empty, ready, g_buf, gs_buf, u_buf, us_buf, x_buf, rows_tab, item,
                 expert, i, routed_grid, STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                 BLOCK_M: gl.constexpr, SELF: gl.constexpr):
    """One routed item of `_consumer`; returns the ring position after it."""
    slot0, tile = _place(item, I // 128, BLOCK_M)
    g = (item - gl.program_id(0)) // routed_grid  # (`SELF`: its table row)
    return gate_up_item(sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr,
                        num_pairs, stride_h, slot0, tile, expert, i, empty, ready, g_buf,
                        gs_buf, u_buf, us_buf, x_buf, STAGES, H, BLOCK_M, rows_tab, g, SELF)


@gluon.jit
def _consumer(sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_pairs,
              stride_h, empty, ready, g_buf, gs_buf, u_buf, us_buf, xs_buf, x_buf, ids, rows_tab,
              STAGES: gl.constexpr, H: gl.constexpr, I: gl.constexpr, BLOCK_M: gl.constexpr,
              SELF: gl.constexpr, routed_grid=1, shared_slot=0, h_row0=0, num_tokens=0,
              SHARED_ITEMS: gl.constexpr = False):
    """Runs the items the producer tagged, in its order, until the tag -1 (`SELF`: the routed
    items' pairs from the program's table, row (item - p) / routed_grid, written into
    `sorted_pair` too, `gate_up_item`; `SHARED_ITEMS`: the shared expert's items,
    `_nvfp4_shared_items`)."""
    i = 0  # ring slots consumed so far
    tag = _tag(ids, ready, i, STAGES)
    while tag >= 0:
        item, expert = tag // 1024, tag % 1024
        args = (sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_pairs,
                stride_h, empty, ready, g_buf, gs_buf, u_buf, us_buf, x_buf, rows_tab, item,
                expert, i, routed_grid)
        if SHARED_ITEMS:
            if expert == SHARED_TAG:
                i = shared_gate_up_item(h_ptr, count_ptr, shared_slot, h_row0, num_tokens,
                                        stride_h, item, i, empty, ready, g_buf, u_buf, xs_buf,
                                        STAGES, H)
            else:
                i = _routed_item(*args, STAGES, H, I, BLOCK_M, SELF)
        else:
            i = _routed_item(*args, STAGES, H, I, BLOCK_M, SELF)
        tag = _tag(ids, ready, i, STAGES)


@gluon.jit
def _gate_up_gluon_kernel(g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr,
                          gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_items, num_pairs,
                          shared_id, stride_h, a_row_div, STAGES: gl.constexpr,
                          H: gl.constexpr, I: gl.constexpr, BLOCK_M: gl.constexpr,
                          PDL_ENTER: gl.constexpr = False, ids_ptr=None,
                          SELF: gl.constexpr = False, G: gl.constexpr = 1,
                          PAIRS_PAD: gl.constexpr = 16, EXPERTS_PAD: gl.constexpr = 16,
                          routed_grid=1, sg_d=None, su_d=None, xs_d=None, shared_slot=0,
                          h_row0=0, num_tokens=0, SHARED_ITEMS: gl.constexpr = False):
    """`PDL_ENTER`: wait for the alignment launched before, then let the next kernel launch.
    `SELF` (`PDL_ENTER` off; the op's first launch, no alignment launched): wait for the kernel
    before (which may have written the routing), route each program's `G` items from
    `ids_ptr` (`_nvfp4_self_route`; `PAIRS_PAD`, `EXPERTS_PAD`: powers of two at least the
    pairs and experts), then let the next kernel launch (the producer's later wait after its
    first copies returns at once); the items of N-tile 0 write their parts' pairs into
    `sorted_pair` for the down kernel. `routed_grid` (with `SELF`): the programs that take
    routed items (p + g * routed_grid); `SHARED_ITEMS`: the others run the shared expert's
    gate/up items (`_nvfp4_shared_items`: `sg_d`, `su_d`, `xs_d`; h rows `h_row0 + t` for
    `num_tokens`, counted on `count_ptr[shared_slot]`)."""
    if SELF:
        gdc_wait()
        experts_tab, pairs_tab, rows_tab = route_tables(G)
        self_route(ids_ptr, num_pairs, num_items, experts_tab, pairs_tab, rows_tab, G,
                   I // 128, BLOCK_M, PAIRS_PAD, EXPERTS_PAD, routed_grid)
        gdc_launch_dependents()
    if PDL_ENTER:
        gdc_wait()
        gdc_launch_dependents()
    g_buf, u_buf, gs_buf, us_buf = chunk_rings(g_d, u_d, gs_d, us_d, STAGES)
    xs_buf = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, 8, 64], XS_BOX)
    ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], TAGS)  # one tag per ring slot
    x_buf = gl.allocate_shared_memory(x_d.dtype, [STAGES, 8, 128], x_d.layout)
    if not SELF:  # (placeholders: not read)
        experts_tab, pairs_tab, rows_tab = ids, ids, ids
    empty, ready = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, count_ptr, num_pairs,
                     stride_h, empty, ready, g_buf, gs_buf, u_buf, us_buf, xs_buf, x_buf, ids,
                     rows_tab, STAGES, H, I, BLOCK_M, SELF, routed_grid, shared_slot, h_row0,
                     num_tokens, SHARED_ITEMS)),
        (_any_producer, (g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr,
                         num_items, num_pairs, shared_id, a_row_div, empty, ready, g_buf,
                         gs_buf, u_buf, us_buf, xs_buf, x_buf, ids, experts_tab, pairs_tab,
                         STAGES, H, I, BLOCK_M, SELF, G, routed_grid, sg_d, su_d, xs_d,
                         SHARED_ITEMS)),
    ], [1], [40])


def self_routes(topk_ids: torch.Tensor, num_pairs: int, num_experts: int) -> bool:
    """Whether `launch_gate_up_gluon`'s programs can route their own items
    (`_nvfp4_self_route`): `topk_ids` holds the routing's `num_pairs` ids, within the tables'
    limits."""
    return topk_ids.numel() == num_pairs and self_route_fits(num_pairs, num_experts)


def gate_up_gluon_applies(inter: int, num_experts: int) -> bool:
    """Whether `nvfp4_moe`, where it runs the Gluon down kernel without the shared expert in
    the routing, runs its routed gate/up with this kernel: I a multiple of 256 (the down
    kernel's self-routing reads gate/up's pairs after its second K-step) and fewer than 1024
    experts (the ring's item tags)."""
    return inter % 256 == 0 and num_experts < 1024


def programs_per_sm(device: torch.device, stages: int = STAGES, per_sm: int = PROGRAMS_PER_SM,
                    maxnreg: int = MAXNREG) -> int:
    """`per_sm`, capped at the programs that fit on one SM together (shared memory: the ring,
    1 KB for barriers, 1 KB the driver reserves; registers: `maxnreg` for each of `THREADS`).
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


def launch_gate_up_gluon(x: torch.Tensor, sorted_pair: torch.Tensor,
                         expert_of_block: torch.Tensor, weights: tuple[torch.Tensor, ...],
                         alphas: tuple[torch.Tensor, ...], h: torch.Tensor, count: torch.Tensor,
                         num_pairs: int, shared_id: int, a_row_div: int,
                         topk_ids: torch.Tensor | None = None,
                         shared_items: tuple | None = None) -> None:
    """h[slot] = silu(x @ gate^T) * (x @ up^T) (each 128 columns even first) for the routed
    pairs of the routing (`sorted_pair`, `expert_of_block`: 16-, 32- or 64-slot blocks; blocks
    of expert `shared_id` skipped), launched with PDL: its programs wait for the alignment
    launched before. x bf16 `[rows, H]` (pair p reads row p // `a_row_div`); `weights`: gate,
    gate codes, up, up codes (v7's stored forms, viewed as bytes); `alphas`: fp32 `[E]` gate,
    up; h bf16 `[S, I]`; `count`: `moe_overlap.counters` (each item counts itself done on its
    routing block's counter).
    `topk_ids` (`[T, K]`, `num_pairs` ids over `shared_id` experts; `self_routes` must hold):
    the op's first launch, no alignment made; the programs wait for the kernel before, route
    their items themselves, then let the down kernel launch (which routes itself too), and
    write their parts' pairs into `sorted_pair` for it (`expert_of_block` only gives the
    shape). `shared_items` (with `topk_ids`): `_nvfp4_shared_items`' items, run by the last
    `gate_up_programs(I)` programs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    H, I = x.shape[1], h.shape[1]
    descs = [d for words, codes in zip(weights[::2], weights[1::2], strict=True)
             for d in _descriptors(words, codes)]
    descs.append(TensorDescriptor.from_tensor(x, [1, 128], x_layout()))
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    num_items = expert_of_block.shape[0] * (block_m // 8) * (I // 128)
    check_item_tags(num_items, shared_id, "the Gluon gate/up kernel")
    args = (*descs, expert_of_block, sorted_pair, *alphas, h, count, num_items, num_pairs,
            shared_id, h.stride(0), a_row_div)
    routed = topk_ids is not None
    if routed and not self_routes(topk_ids, num_pairs, shared_id):
        raise ValueError(f"launch_gate_up_gluon: the programs route at most "
                         f"{_nvfp4_self_route.MAX_PAIRS} pairs of {num_pairs} ids over "
                         f"{_nvfp4_self_route.MAX_EXPERTS} experts themselves, got "
                         f"{topk_ids.numel()} ids over {shared_id} experts")
    if shared_items is not None and not routed:
        raise ValueError("launch_gate_up_gluon: shared items need a self-routed launch")
    options = {"STAGES": STAGES, "H": H, "I": I, "BLOCK_M": block_m, "PDL_ENTER": not routed,
               "num_warps": 4, "maxnreg": MAXNREG, "launch_pdl": True}
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    shared_n = 0 if shared_items is None else gate_up_programs(I)  # programs of shared items
    if routed:
        options |= {"ids_ptr": topk_ids.reshape(-1), "SELF": True,
                    **table_pads(num_pairs, shared_id),
                    "routed_grid": sms * programs_per_sm(x.device) - shared_n}
        options["G"] = -(-num_items // options["routed_grid"])
    if shared_items is not None:
        options |= gate_up_item_options(shared_items, x)
    key = (x.device, H, I, block_m, routed, shared_n)
    if key not in _PROGRAMS:  # compiled (not launched) once per form: what fits at once
        compiled = _gate_up_gluon_kernel.warmup(*args, grid=(1,), **options)
        fit = min(programs_per_sm(x.device),
                  resident_programs(compiled, 32 * compiled.metadata.num_warps))
        if fit < 1:
            raise RuntimeError(f"nvfp4_moe: the Gluon gate/up kernel (STAGES={STAGES}, "
                               f"MAXNREG={MAXNREG}) does not fit on an SM of {x.device}")
        _PROGRAMS[key] = fit * sms
    if routed:  # each program's items: p, p + routed_grid, ...
        routed_grid = _PROGRAMS[key] - shared_n
        options |= {"G": -(-num_items // routed_grid), "routed_grid": routed_grid}
    _gate_up_gluon_kernel[(_PROGRAMS[key],)](*args, **options)
