"""`dlmc::nvfp4_moe`'s routed down projection as a persistent, warp-specialized Gluon kernel
(sm_90, kernel v7's stored forms).

Work items are (8-slot part of a routing block, N-tile of 128): a part whose first slot is
padding has no pair (pairs come first in a block) and is skipped, so ~1.6 tokens per expert
take one part. One producer warp per program copies each K-step's v7 weight chunk (8 KB,
128-byte swizzle), its block-scale codes (1 KB) and the part's 8 h rows (two 1 KB halves) with
TMA into a 4-deep ring; four consumer warps read the words with `ldmatrix` straight into the
A-operand layout of `mma_v2` (the weights are A: 16 rows x 16 K per `HMMA`, the 8 slots B, half
the `HMMA`s of the Triton kernel's 16-slot B tiles), decode them with v7's asm
(`nvfp4_words.DECODE_WORDS_ASM`, `w * scale * 2^-7`) and accumulate in fp32: the same products
and sums as the Triton down kernel, bit for bit (GPU tests).

h layout: the gate/up kernel stores each routed row's 128-column K-steps even columns first,
then odd (`H_EVEN_ODD`), so the two TMA halves are the B operands of the low- and high-nibble
MMAs. The kernel is launched with PDL while gate/up runs (`moe_overlap`): its programs take
their items from a ticket counter, so that programs which start late, on SMs that gate/up's
programs still hold, take fewer; for each item the producer spins until gate/up has stored the
routing block's rows, fences, and copies them with TMA. Design: docs/nvfp4.md §3.2.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from dlmc.custom_ops._nvfp4_down_self_route import (
    down_route_tables,
    fill_down_tables,
    self_item,
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
    _wait_live_rows,
    _wait_rows,
    check_item_tags,
    gdc_launch_dependents,
    gdc_wait,
    ring_barriers,
    shared_layouts,
)
from dlmc.custom_ops._nvfp4_gluon_ring import release_slot, wait_slot
from dlmc.custom_ops._nvfp4_self_route import table_pads
from dlmc.custom_ops._nvfp4_shared_items import (
    SHARED_TAG,
    down_item_options,
    shared_down_copies,
    shared_down_item,
)
from dlmc.custom_ops._pdl import INTERPRETED

__all__ = ["down_gluon_applies", "launch_down_gluon"]

STAGES, PROGRAMS_PER_SM, MAXNREG = 4, 3, 80  # ring depth, programs per SM, registers per thread


def down_gluon_applies(device: torch.device, variant: int, block_m: int) -> bool:
    """Whether `nvfp4_moe`, launching with PDL (`moe_overlap.overlap_pdl`), runs its routed
    down projection with this kernel: kernel v7's stored forms (`variant` 7: H and I multiples
    of 128), 16-slot routing blocks (a denoising block's few tokens per expert; prompt chunks'
    32- and 64-slot blocks keep the Triton kernel) and a CUDA device of compute capability 9.0
    (not the CPU interpreter)."""
    return (variant == 7 and block_m == 16 and not INTERPRETED and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


@gluon.jit
def _weight_copies(w_d, s_d, run, k, bar, w_slot, s_slot, I: gl.constexpr):
    """TMA copies of K-step k of weight run `run` (v7's tiled words: chunk k at byte
    run * 128 * I/2 + k * 8192, its codes at byte run * 128 * I/16 + k * 1024; descriptor rows
    of 128 bytes) into a ring slot, counted on `bar`."""
    tma.async_copy_global_to_shared(w_d, [run * (I // 2) + k * 64, 0], bar, w_slot)
    tma.async_copy_global_to_shared(s_d, [run * (I // 16) + k * 8, 0], bar, s_slot)


@gluon.jit
def _h_copies(h_d, slot0, k, bar, h_buf, s):
    """TMA copies of K-step k of the part's 8 h rows (even and odd halves) into ring slot s."""
    tma.async_copy_global_to_shared(h_d, [slot0, k * 128], bar, h_buf.index(2 * s))
    tma.async_copy_global_to_shared(h_d, [slot0, k * 128 + 64], bar, h_buf.index(2 * s + 1))


@gluon.jit
def _ring_item(sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, slot0, tile, expert, i,
               empty, ready, w_buf, s_buf, h_buf, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
               SELF: gl.constexpr = False, PAIR_GAP: gl.constexpr = 0):
    """y rows of the part's pairs, columns tile * 128 + [0, 128), with the weights, codes and
    h rows all from the ring (ring slots i, i + 1, ...); returns the ring position after it.
    `SELF` (`_nvfp4_down_self_route`, KSTEPS >= 2): the part's pairs, which gate/up wrote
    before the counts that the producer acquired after filling the item's first slot, are
    read after the second slot's wait (the producer filled it after that acquire).
    `PAIR_GAP` (K, not 0): pair p's y row is p + p // K (a shared expert's row after each
    token's K routed rows, `_nvfp4_shared_items`)."""
    # the epilogue's loads before the K loop (their latency hides there)
    alpha = gl.load(alpha_ptr + expert) * 128.0  # * 2^7: the decode's w * 2^-7
    offs = slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA))
    if not SELF:
        pairs = gl.load(sorted_pair_ptr + offs)
    acc = gl.zeros([128, 8], gl.float32, MMA)
    for k in gl.static_range(KSTEPS):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if SELF and k == 1:
            pairs = gl.load(sorted_pair_ptr + offs)
        words, codes = _chunk(w_buf.index(s), s_buf.index(s))
        h_even = h_buf.index(2 * s).permute([1, 0]).load(H_OP)
        h_odd = h_buf.index(2 * s + 1).permute([1, 0]).load(H_OP)
        release_slot(empty, s)
        acc = _mma_chunk(words, codes, h_even, h_odd, acc)
        i += 1
    cols = tile * 128 + gl.arange(0, 128, gl.SliceLayout(1, MMA))
    rows = pairs
    if PAIR_GAP:  # (padding pairs, num_pairs, are masked)
        rows = pairs + pairs // PAIR_GAP
    _store_tile(y_ptr, rows, stride_y, cols, (acc * alpha).to(gl.bfloat16), pairs < num_pairs)
    return i


@gluon.jit
def _ticket_producer(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr, num_slots,
                     writers, num_items, num_pairs, shared_id, empty, ready, w_buf, s_buf, h_buf,
                     ids, STAGES: gl.constexpr, KSTEPS: gl.constexpr, TILES: gl.constexpr,
                     I: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                     PER_PART: gl.constexpr, counts=None, ends=None,
                     SELF: gl.constexpr = False, EXPERTS_PAD: gl.constexpr = 16, shared=None,
                     SHARED_ITEMS: gl.constexpr = 0):
    """The producer warp: the next unclaimed item from the ticket counter, taken one item ahead;
    items without work skipped; each slot tagged with its item. After an item's first weight
    copies this warp spins until gate/up has stored the routing block's h rows (`_wait_rows`,
    counting itself as the item's reader), then fences, so that its TMA copies read those
    rows. `SELF`: the items' experts from the tables `counts`, `ends`
    (`_nvfp4_down_self_route`); their pairs, which the consumers read, gate/up has written
    before its counts. `SHARED_ITEMS` (their number):
    the shared expert's items, tickets 0.., before the routed ones (`_nvfp4_shared_items`;
    `shared`: the down and h descriptors, the shared slot, its writers, h's shared row0)."""
    ticket = count_ptr + 2 * num_slots
    item = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    i = 0  # K-steps copied so far (the ring position)
    routed = (w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr, num_slots,
              writers, num_items, num_pairs, shared_id, empty, ready, w_buf, s_buf, h_buf, ids,
              counts, ends)
    while item < num_items + SHARED_ITEMS:
        after = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")  # read after the copies
        if SHARED_ITEMS:
            if item < SHARED_ITEMS:
                sd_d, hs_d, shared_slot, shared_writers, h_row0 = shared
                i = shared_down_copies(sd_d, hs_d, count_ptr, num_slots, shared_slot,
                                       shared_writers, SHARED_ITEMS, item, h_row0, i, empty,
                                       ready, w_buf, h_buf, ids, item * 1024 + SHARED_TAG,
                                       STAGES, TILES, I)
            else:
                i = _item_copies(*routed, item - SHARED_ITEMS, i, STAGES, KSTEPS, TILES, I, H,
                                 BLOCK_M, PER_PART, SELF, EXPERTS_PAD)
        else:
            i = _item_copies(*routed, item, i, STAGES, KSTEPS, TILES, I, H, BLOCK_M, PER_PART,
                             SELF, EXPERTS_PAD)
        item = after
    _end_tickets(ticket, item, num_items + SHARED_ITEMS, ids, empty, ready, i, STAGES)


@gluon.jit
def _item_copies(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr, num_slots,
                 writers, num_items, num_pairs, shared_id, empty, ready, w_buf, s_buf, h_buf, ids,
                 counts, ends, item, i, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                 TILES: gl.constexpr, I: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                 PER_PART: gl.constexpr, SELF: gl.constexpr, EXPERTS_PAD: gl.constexpr):
    """`_ticket_producer`'s copies of routed item `item`; returns the ring position after."""
    if SELF:
        slot0, tile, expert, has_work, live = self_item(
            counts, ends, item, num_items, TILES, BLOCK_M, EXPERTS_PAD)
    else:
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
    if has_work:
        run = expert * (H // 128) + tile
        for k in gl.static_range(KSTEPS):
            s = i % STAGES
            wait_slot(empty, i, STAGES)
            _tag_slot(ids, s, item * 1024 + expert)
            bar = ready.index(s)
            mbarrier.expect(bar, w_d.block_type.nbytes + s_d.block_type.nbytes
                            + 2 * h_d.block_type.nbytes)
            _weight_copies(w_d, s_d, run, k, bar, w_buf.index(s), s_buf.index(s), I)
            if k == 0:
                if SELF:
                    _wait_live_rows(count_ptr, num_slots, slot0 // BLOCK_M, live, writers,
                                    TILES, PER_PART)
                else:
                    _wait_rows(count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0,
                               writers, TILES, BLOCK_M, PER_PART, 1)
                _fence_proxy_async_global()
            _h_copies(h_d, slot0, k, bar, h_buf, s)
            i += 1
    return i


@gluon.jit
def _ticket_consumer(sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, empty, ready,
                     w_buf, s_buf, h_buf, ids, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                     TILES: gl.constexpr, BLOCK_M: gl.constexpr, SELF: gl.constexpr = False,
                     PAIR_GAP: gl.constexpr = 0, num_tokens=0, SHARED_ITEMS: gl.constexpr = 0):
    """The consumer warps: the items the producer tagged, in its order, until the tag -1
    (`SELF`, `PAIR_GAP`: `_ring_item`'s; `SHARED_ITEMS`: the shared expert's, for
    `num_tokens` tokens of `PAIR_GAP` pairs each)."""
    i = 0  # K-steps consumed so far
    tag = _tag(ids, ready, i, STAGES)
    while tag >= 0:
        item, expert = tag // 1024, tag % 1024
        slot0, tile = _place(item, TILES, BLOCK_M)  # (a routed item's)
        routed = (sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, slot0, tile, expert,
                  i, empty, ready, w_buf, s_buf, h_buf)
        if SHARED_ITEMS:
            if expert == SHARED_TAG:
                i = shared_down_item(y_ptr, stride_y, num_tokens, PAIR_GAP, item, i, empty,
                                     ready, w_buf, h_buf, STAGES, TILES, KSTEPS * 128)
            else:
                i = _ring_item(*routed, STAGES, KSTEPS, SELF, PAIR_GAP)
        else:
            i = _ring_item(*routed, STAGES, KSTEPS, SELF, PAIR_GAP)
        tag = _tag(ids, ready, i, STAGES)


@gluon.jit
def _down_gluon_kernel(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, alpha_ptr, y_ptr,
                       num_items, num_pairs, shared_id, stride_y, count_ptr, num_slots, writers,
                       STAGES: gl.constexpr, KSTEPS: gl.constexpr, TILES: gl.constexpr,
                       I: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                       PER_PART: gl.constexpr = False, ids_ptr=None,
                       SELF: gl.constexpr = False, PAIRS_PAD: gl.constexpr = 16,
                       EXPERTS_PAD: gl.constexpr = 16, PAIR_GAP: gl.constexpr = 0,
                       sd_d=None, hs_d=None, shared_slot=0, shared_writers=0, h_row0=0,
                       num_tokens=0, SHARED_ITEMS: gl.constexpr = 0):
    """Launched with PDL while gate/up runs: lets the next kernel launch at once; the items
    come from the ticket counter `count_ptr[2 * num_slots]` (zero between launches) in turn,
    and the producer waits per routing block for gate/up's h rows (`moe_overlap`'s counters in
    `count_ptr`, `writers` gate/up programs per block; `PER_PART`: `writers` per 8-slot part
    that holds a pair, the Gluon gate/up items of `_nvfp4_gate_up_gluon`) and copies them.
    `SELF`: no alignment; the items' routing from `ids_ptr` (`_nvfp4_down_self_route`;
    `PAIRS_PAD`, `EXPERTS_PAD`: powers of two at least the pairs and experts; the launch before
    has waited for the routing's writer). `PAIR_GAP`: y rows as `_ring_item`'s.
    `SHARED_ITEMS` (with `SELF`; their number): the shared expert's items, the first tickets
    (`_nvfp4_shared_items`: `sd_d`, `hs_d`; h rows `h_row0 + t` of `num_tokens`, after
    `shared_writers` counts on `shared_slot`)."""
    gdc_launch_dependents()
    w_buf = gl.allocate_shared_memory(w_d.dtype, [STAGES] + w_d.block_type.shape, w_d.layout)
    s_buf = gl.allocate_shared_memory(s_d.dtype, [STAGES] + s_d.block_type.shape, s_d.layout)
    h_buf = gl.allocate_shared_memory(h_d.dtype, [2 * STAGES] + h_d.block_type.shape,
                                      h_d.layout)
    empty, ready = ring_barriers(STAGES)
    ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], TAGS)  # one tag per ring slot
    if SELF:
        counts, ends = down_route_tables(EXPERTS_PAD)
        fill_down_tables(ids_ptr, num_pairs, counts, ends, BLOCK_M, PAIRS_PAD, EXPERTS_PAD)
    else:  # (placeholders: not read)
        counts, ends = ids, ids
    gl.warp_specialize([
        (_ticket_consumer, (sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, empty,
                            ready, w_buf, s_buf, h_buf, ids, STAGES, KSTEPS, TILES,
                            BLOCK_M, SELF, PAIR_GAP, num_tokens, SHARED_ITEMS)),
        (_ticket_producer, (w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr,
                            num_slots, writers, num_items, num_pairs, shared_id, empty,
                            ready, w_buf, s_buf, h_buf, ids, STAGES, KSTEPS, TILES, I, H,
                            BLOCK_M, PER_PART, counts, ends, SELF, EXPERTS_PAD,
                            (sd_d, hs_d, shared_slot, shared_writers, h_row0),
                            SHARED_ITEMS)),
    ], [1], [40])
    # finish only after the kernel before (the shared expert's down parts) has: the kernel
    # after (the combine) waits for this one alone
    gdc_wait()


def launch_down_gluon(h: torch.Tensor, sorted_pair: torch.Tensor, expert_of_block: torch.Tensor,
                      words: torch.Tensor, codes: torch.Tensor, alpha: torch.Tensor,
                      y: torch.Tensor, num_pairs: int, shared_id: int, count: torch.Tensor,
                      num_slots: int, writers: int, per_part: bool = False,
                      topk_ids: torch.Tensor | None = None, pair_gap: int = 0,
                      shared_items: tuple | None = None) -> None:
    """y[pair] = bf16(alpha[e] * h[slot] @ down[e]^T) for every routed pair of the routing
    (`sorted_pair`, `expert_of_block`: blocks of 16, 32 or 64 slots, cut into 8-slot parts;
    blocks of expert `shared_id` skipped). h bf16 `[S, I]` with `H_EVEN_ODD` columns; words
    uint8 `[E, H, I/2]` and codes uint8 `[E, H, I/16]` (v7's stored forms viewed as bytes),
    alpha fp32 `[E]`, y bf16 `[P, H]`.
    Launched with PDL during gate/up, ending with `griddepcontrol.wait` (its completion implies
    the launch before's): the kernel waits per block for gate/up's rows on `count`
    (`moe_overlap.counters`, `num_slots` slots, `writers` gate/up programs per routing block;
    `per_part`: `writers` per 8-slot part that holds a pair, gate/up in
    `_nvfp4_gate_up_gluon`'s items) and hands the items out by the ticket counter after the
    slots' (`2 * num_slots + 1` counters).
    `topk_ids` (`[T, K]`, `num_pairs` ids over `shared_id` experts): the programs route their
    items themselves (`_nvfp4_down_self_route`); `sorted_pair` and `expert_of_block` then only
    give the shapes (`moe_align.alignment_buffers`, unwritten). The launch before must have
    waited for the routing's writer (the self-routed gate/up launched first).
    `pair_gap` (K): pair p's y row is p + p // K (a shared expert's row after every K).
    `shared_items` (with `topk_ids`, `pair_gap`): `_nvfp4_shared_items`' items."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if count.numel() < 2 * num_slots + 1:
        raise ValueError(f"nvfp4_moe: the Gluon down kernel needs {2 * num_slots + 1} counters "
                         f"(`moe_overlap.counters(device, num_slots + 1)`), got {count.numel()}")
    E, H, half_i = words.shape
    I = 2 * half_i
    w_l, s_l, h_l = shared_layouts()
    w_d = TensorDescriptor.from_tensor(words.view(-1, 128), [64, 128], w_l)
    s_d = TensorDescriptor.from_tensor(codes.view(torch.int32).view(-1, 32), [8, 32], s_l)
    h_d = TensorDescriptor.from_tensor(h, [8, 64], h_l)
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    items = expert_of_block.shape[0] * (block_m // 8) * (H // 128)
    check_item_tags(items, shared_id, "the Gluon down kernel")
    self_route = {}
    if topk_ids is not None:
        if topk_ids.numel() != num_pairs or I < 256:
            raise ValueError(f"launch_down_gluon: self-routing needs {num_pairs} ids and I >= "
                             f"256 (two K-steps), got {topk_ids.numel()} ids, I={I}")
        self_route = {"ids_ptr": topk_ids.reshape(-1), "SELF": True,
                      **table_pads(num_pairs, shared_id)}
    if shared_items is not None:
        if not (self_route and pair_gap):
            raise ValueError("launch_down_gluon: shared items need self-routing and pair_gap")
        self_route |= down_item_options(shared_items, h)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    _down_gluon_kernel[(sms * PROGRAMS_PER_SM,)](
        w_d, s_d, h_d, expert_of_block, sorted_pair, alpha, y, items, num_pairs, shared_id,
        y.stride(0), count, num_slots, writers, STAGES=STAGES, KSTEPS=I // 128, TILES=H // 128,
        I=I, H=H, BLOCK_M=block_m, PER_PART=per_part, **self_route, PAIR_GAP=pair_gap,
        num_warps=4, maxnreg=MAXNREG, launch_pdl=True)
