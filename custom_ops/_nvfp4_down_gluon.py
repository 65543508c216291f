"""`dlmc::nvfp4_moe`'s routed down projection as a persistent, warp-specialized Gluon kernel
(`DLMC_NVFP4_DOWN=gluon`, sm_90, kernel v7's stored forms).

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
MMAs. Measured alone (perf/proto_gluon_down.py, graph replays, H200): 29.4 against the Triton
down kernel's 34.9 µs per LLaDA2.1-mini layer (perf/README.md, session 24).

In the op (`moe_overlap`: launched with PDL while gate/up runs) the programs take their items
from a ticket counter (`TICKETS`, the default): programs that start late, on SMs that gate/up's
programs still hold, take fewer items; for each item the producer spins until gate/up has
stored the routing block's rows, fences, and copies them with TMA. Session 26: op 92.0-92.9
against 96.3-97.2 µs per layer (routed experts only; by program 108 µs), the default since.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from dlmc.custom_ops._pdl import INTERPRETED
from dlmc.custom_ops.nvfp4_scale_codes import PAIR_ADD, PAIR_MUL
from dlmc.custom_ops.nvfp4_words import DECODE_WORDS_ASM
from dlmc.errors import ConfigError

__all__ = ["MODE", "SHARED_DOWN", "TAGS", "TICKETS", "down_gluon_applies", "down_tickets",
           "gdc_launch_dependents", "gdc_wait", "launch_down_gluon", "ring_barriers",
           "shared_down_in_gate_up"]

_ASM = gl.constexpr(DECODE_WORDS_ASM.value)
_PMUL, _PADD = gl.constexpr(PAIR_MUL), gl.constexpr(PAIR_ADD)
STAGES, PROGRAMS_PER_SM, MAXNREG = 4, 3, 80  # the prototype's best (session 24, call 10)

# Layouts (4 warps). The MMA's accumulator [128 n, 8 slots]: warps split the weight rows.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, 8]))
W_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=4))
H_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=4))
# W_OP's elements as bytes [n 128, block 8, half 2, byte 4]: registers -> byte, n bit 3,
# block bits 1-2, n bit 6; lanes -> half, block bit 0, n bits 0-2; warps -> n bits 4-5
W4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0],
               [64, 0, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[128, 8, 2, 4]))
# the same elements in a chunk's [64, 128] bytes (row r = weight rows 2r, 2r+1)
WL2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [4, 0], [0, 16], [0, 32], [32, 0]],
    lane_bases=[[0, 4], [0, 8], [0, 64], [1, 0], [2, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[64, 128]))
CODES_L = gl.constexpr(gl.SliceLayout(2, gl.SliceLayout(3, W4.value)))
W_BYTES = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
TAG_L = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # the producer warp's tag store
TAGS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # a slot's tag: a rank-1 view


def _mode() -> str:
    """DLMC_NVFP4_DOWN: gluon (the default since session 26: where `down_gluon_applies`, this
    kernel with its items by ticket; op 92.0-92.9 against 96.3-97.2 µs per LLaDA2.1-mini layer
    for the routed experts, 94.2-96.1 against 95.6-96.0 with the shared expert, the NVFP4 round
    1.8-2.1 % faster queued in three calls; perf/README.md), triton (the Triton down kernel
    everywhere) or fused (gate/up and down in `_nvfp4_moe_gluon`)."""
    value = os.environ.get("DLMC_NVFP4_DOWN", "gluon")
    if value not in ("triton", "gluon", "fused"):
        raise ConfigError(f"DLMC_NVFP4_DOWN={value!r}: expected gluon (the default: this kernel "
                          "where it applies), triton (the Triton down kernel) or fused (gate/up "
                          "and down in `_nvfp4_moe_gluon`)")
    return value


MODE = _mode()  # read at import; tests and benches may set it per call


def _tickets() -> bool:
    value = os.environ.get("DLMC_NVFP4_DOWN_TICKETS", "1")
    if value not in ("0", "1"):
        raise ConfigError(f"DLMC_NVFP4_DOWN_TICKETS={value!r}: expected 1 (the default: items "
                          "by a ticket counter) or 0 (items by program)")
    return value == "1"


# `TICKETS` (with overlap): items handed out by a counter (`count[2 * num_slots]`) instead of by
# program, so that programs which start late (on SMs that gate/up's programs still hold) take
# fewer items: 92.0-92.9 against 106-108 µs per LLaDA2.1-mini layer for the op without them
# (routed experts only; perf/README.md, session 26). Read at import; benches may set it.
TICKETS = _tickets()


def _shared_down() -> str:
    value = os.environ.get("DLMC_NVFP4_SHARED_DOWN", "own")
    if value not in ("own", "gate_up"):
        raise ConfigError(f"DLMC_NVFP4_SHARED_DOWN={value!r}: expected own (the default: the "
                          "shared expert's down parts in a Triton launch of their own before "
                          "this kernel) or gate_up (as the last programs of gate/up's launch)")
    return value


# where the shared expert's down parts run with this kernel (read at import; benches may set
# it): "gate_up" is not measured yet (session 26)
SHARED_DOWN = _shared_down()


def down_gluon_applies(device: torch.device, variant: int, hidden: int, inter: int,
                       emulate_w4a4: bool, opaque: bool, block_m: int) -> bool:
    """Whether `nvfp4_moe` runs its routed down projection with this kernel: `MODE` "gluon",
    kernel v7's stored forms (`variant` 7, H and I multiples of 128), no W4A4 emulation, the op
    registered opaque (its body launches kernels itself), a CUDA device of compute capability
    9.0, not the CPU interpreter, and 16-slot routing blocks (a denoising block's few tokens
    per expert). The kernel takes 32- and 64-slot blocks too (prompt chunks), but their GPU
    test has not passed yet (perf/README.md, session 24): they keep the Triton kernel."""
    return (MODE == "gluon" and variant == 7 and hidden % 128 == 0 and inter % 128 == 0
            and not emulate_w4a4 and opaque and block_m == 16 and not INTERPRETED
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def shared_down_in_gate_up() -> bool:
    """`SHARED_DOWN` as now set is "gate_up" (`DLMC_NVFP4_SHARED_DOWN`)."""
    return SHARED_DOWN == "gate_up"


def down_tickets() -> bool:
    """`TICKETS` as now set (`DLMC_NVFP4_DOWN_TICKETS`, 1 by default, or set by a bench)."""
    return TICKETS


@gluon.jit
def _place(item, TILES: gl.constexpr, BLOCK_M: gl.constexpr):
    """(first slot, N-tile) of a work item: an 8-slot part of a routing block of `BLOCK_M`
    slots and one of `TILES` N-tiles, the tile fastest, then the part, then the block."""
    PARTS: gl.constexpr = BLOCK_M // 8
    slot0 = (item // (PARTS * TILES)) * BLOCK_M + ((item // TILES) % PARTS) * 8
    return slot0, item % TILES


@gluon.jit
def _item(expert_of_block_ptr, sorted_pair_ptr, item, num_items, num_pairs, shared_id,
          TILES: gl.constexpr, BLOCK_M: gl.constexpr):
    """(first slot, N-tile, expert) of a work item (`_place`) and whether it has work: a
    routed expert's block whose part starts with a pair."""
    slot0, tile = _place(item, TILES, BLOCK_M)
    live = item < num_items
    expert = gl.load(expert_of_block_ptr + slot0 // BLOCK_M, mask=live, other=-1)
    first = gl.load(sorted_pair_ptr + slot0, mask=live, other=num_pairs)
    has_work = (expert >= 0) & (expert != shared_id) & (first < num_pairs)
    return slot0, tile, expert, has_work


@gluon.jit
def _producer(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, num_items, num_pairs,
              shared_id, empty, ready, w_buf, s_buf, h_buf, STAGES: gl.constexpr,
              KSTEPS: gl.constexpr, TILES: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
              BLOCK_M: gl.constexpr, OVERLAP: gl.constexpr):
    i = 0  # K-steps copied so far (the ring position)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if has_work:
            run = expert * (H // 128) + tile  # the item's 128-row run of weight rows
            for k in gl.static_range(KSTEPS):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if OVERLAP:  # h rows: loaded by the consumers once gate/up has written them
                    mbarrier.expect(bar, w_d.block_type.nbytes + s_d.block_type.nbytes)
                else:
                    mbarrier.expect(bar, w_d.block_type.nbytes + s_d.block_type.nbytes
                                    + 2 * h_d.block_type.nbytes)
                # v7's tiled words: the run's chunk k at byte (run * 128 * I/2 + k * 8192),
                # codes at byte (run * 128 * I/16 + k * 1024); descriptor rows of 128 bytes
                tma.async_copy_global_to_shared(w_d, [run * (I // 2) + k * 64, 0], bar,
                                                w_buf.index(s))
                tma.async_copy_global_to_shared(s_d, [run * (I // 16) + k * 8, 0], bar,
                                                s_buf.index(s))
                if not OVERLAP:
                    tma.async_copy_global_to_shared(h_d, [slot0, k * 128], bar,
                                                    h_buf.index(2 * s))
                    tma.async_copy_global_to_shared(h_d, [slot0, k * 128 + 64], bar,
                                                    h_buf.index(2 * s + 1))
                i += 1


@gluon.jit
def _h_step(h_ptr, slot0, stride_h, k):
    """(even, odd) B operands of K-step k loaded from global memory: h rows slot0..slot0+7,
    columns k * 128 + [0, 64) and [64, 128) (`H_EVEN_ODD`'s even and odd columns)."""
    kk = gl.arange(0, 64, gl.SliceLayout(1, H_OP))
    slots = slot0 + gl.arange(0, 8, gl.SliceLayout(0, H_OP))
    ptrs = (h_ptr + gl.expand_dims(slots.to(gl.int64) * stride_h, 0)
            + gl.expand_dims(k * 128 + kk, 1))
    return gl.load(ptrs), gl.load(ptrs + 64)


@gluon.jit
def _live_parts(sorted_pair_ptr, num_pairs, block, BLOCK_M: gl.constexpr,
                WARPS: gl.constexpr = 4):
    """How many 8-slot parts of routing block `block` hold a pair (pairs come first); `WARPS`:
    the calling partition's warps."""
    parts = gl.arange(0, BLOCK_M // 8, gl.BlockedLayout([1], [32], [WARPS], [0]))
    firsts = gl.load(sorted_pair_ptr + block * BLOCK_M + parts * 8)
    return gl.sum((firsts < num_pairs).to(gl.int32), axis=0)


@gluon.jit
def _wait_rows(count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0, writers,
               TILES: gl.constexpr, BLOCK_M: gl.constexpr, PER_PART: gl.constexpr = False,
               WARPS: gl.constexpr = 4):
    """`moe_overlap.wait` for this kernel: spin until the `writers` gate/up programs of the
    item's routing block (`PER_PART`: `writers` per part that holds a pair) have stored its h
    rows, then count this reader; the last of the block's readers (TILES items per 8-slot part
    that holds a pair) zeroes its counters."""
    block = slot0 // BLOCK_M
    live = _live_parts(sorted_pair_ptr, num_pairs, block, BLOCK_M, WARPS)
    readers = TILES * live
    if PER_PART:
        writers = writers * live
    while gl.atomic_add(count_ptr + block, 0, sem="acquire", scope="gpu") < writers:
        pass
    gl.thread_barrier()
    if gl.atomic_add(count_ptr + num_slots + block, 1, sem="relaxed", scope="gpu") == readers - 1:
        gl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(count_ptr + num_slots + block, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _chunk(w_slot, s_slot):
    """One ring slot's weight chunk as bytes [128, 8, 2, 4] in `W4` (read with `ldmatrix`
    through the 128-byte swizzle) and its block-scale codes [128, 8]."""
    words = w_slot._reinterpret(gl.uint8, [64, 128], W_BYTES).load(WL2)
    words = gl.convert_layout(gl.reshape(words, [128, 8, 2, 4]), W4)
    return words, s_slot._reinterpret(gl.uint8, [128, 8], PLAIN2).load(CODES_L)


@gluon.jit
def _decoded_tiles(words, codes):
    """v7 words (bytes [128, 8, 2, 4]) and their block-scale codes -> the low- and high-nibble
    bf16 tiles [128 n, 64 k'] (`w * scale * 2^-7`, exact)."""
    pair = codes.to(gl.int32) * _PMUL + _PADD
    pair = gl.broadcast(gl.expand_dims(gl.expand_dims(pair, 2), 3), words)[0]
    lo, hi = gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r,r,r", [words, pair],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.reshape(lo, [128, 64]), gl.reshape(hi, [128, 64])


@gluon.jit
def _mma_chunk(words, codes, b_even, b_odd, acc):
    """acc + a weight chunk (decoded, the MMA's A: low nibbles with the even-K B operand, high
    nibbles with the odd-K one)."""
    lo, hi = _decoded_tiles(words, codes)
    acc = mma_v2(gl.convert_layout(lo, W_OP), b_even, acc)
    return mma_v2(gl.convert_layout(hi, W_OP), b_odd, acc)


@gluon.jit
def _store_tile(base_ptr, rows, stride, cols, values, valid):
    """values [128 columns, 8 rows] (`MMA`) to base[rows[r] * stride + cols[c]] where valid[r]."""
    ptrs = base_ptr + gl.expand_dims(rows.to(gl.int64) * stride, 0) + gl.expand_dims(cols, 1)
    mask = gl.expand_dims(valid, 0) & gl.expand_dims(cols >= 0, 1)
    gl.store(ptrs, values, mask=mask)


@gluon.jit
def _consumer(expert_of_block_ptr, sorted_pair_ptr, alpha_ptr, y_ptr, num_items, num_pairs,
              shared_id, stride_y, empty, ready, w_buf, s_buf, h_buf, h_ptr, stride_h,
              count_ptr, num_slots, writers, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
              TILES: gl.constexpr, BLOCK_M: gl.constexpr, OVERLAP: gl.constexpr):
    i = 0  # K-steps consumed so far
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if has_work:
            # the epilogue's loads before the K loop (their latency hides there)
            alpha = gl.load(alpha_ptr + expert) * 128.0  # * 2^7: the decode's w * 2^-7
            pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)))
            acc = gl.zeros([128, 8], gl.float32, MMA)
            if OVERLAP:  # h rows from global memory, once gate/up has stored them
                _wait_rows(count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0, writers,
                           TILES, BLOCK_M)
                h_next = _h_step(h_ptr, slot0, stride_h, 0)
            for k in gl.static_range(KSTEPS):
                s = i % STAGES
                if OVERLAP:
                    h_even, h_odd = h_next
                    if k + 1 < KSTEPS:  # the next K-step's rows, ahead of this step's work
                        h_next = _h_step(h_ptr, slot0, stride_h, k + 1)
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                words, codes = _chunk(w_buf.index(s), s_buf.index(s))
                if not OVERLAP:
                    h_even = h_buf.index(2 * s).permute([1, 0]).load(H_OP)
                    h_odd = h_buf.index(2 * s + 1).permute([1, 0]).load(H_OP)
                fence_async_shared()
                mbarrier.arrive(empty.index(s), count=1)
                acc = _mma_chunk(words, codes, h_even, h_odd, acc)
                i += 1
            cols = tile * 128 + gl.arange(0, 128, gl.SliceLayout(1, MMA))
            _store_tile(y_ptr, pairs, stride_y, cols, (acc * alpha).to(gl.bfloat16),
                        pairs < num_pairs)


@gluon.jit
def _tag_slot(ids, s, tag):
    """The producer writes ring slot s's item tag (`item * 1024 + expert`, -1: no more items)
    before the slot's arrival on `ready` (the same thread: the arrival releases it)."""
    ids.index(s).store(gl.full([1], tag, gl.int32, TAG_L))


@gluon.jit
def _tag(ids, ready, i, STAGES: gl.constexpr):
    """The tag of ring slot i (waiting for the slot first; four consumer warps)."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return gl.max(ids.index(s).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)


@gluon.jit
def _end_tickets(ticket, item, total, ids, empty, ready, i, STAGES: gl.constexpr):
    """After the last item: every program has taken one ticket past the items, and the last
    of those resets the counter; a slot tagged -1 ends the consumers' loop."""
    if item == total + gl.num_programs(0) - 1:
        gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
    s = i % STAGES
    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
    _tag_slot(ids, s, -1)
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _fence_proxy_async_global():
    """Global memory that this thread has acquired (generic proxy) becomes visible to its
    TMA reads (async proxy)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ticket_producer(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr, num_slots,
                     writers, num_items, num_pairs, shared_id, empty, ready, w_buf, s_buf, h_buf,
                     ids, STAGES: gl.constexpr, KSTEPS: gl.constexpr, TILES: gl.constexpr,
                     I: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr):
    """`_producer` with `OVERLAP` and `TICKETS`: the next unclaimed item from the counter,
    taken one item ahead; items without work skipped; each slot tagged with its item. The h
    rows come by TMA as without `OVERLAP`: after the item's first weight copies this warp spins
    until gate/up has stored the routing block's rows (`_wait_rows`, counting itself as the
    item's reader), then fences, so that TMA reads those rows."""
    ticket = count_ptr + 2 * num_slots
    item = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    i = 0  # K-steps copied so far (the ring position)
    while item < num_items:
        after = gl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")  # read after the copies
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if has_work:
            run = expert * (H // 128) + tile
            for k in gl.static_range(KSTEPS):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                _tag_slot(ids, s, item * 1024 + expert)
                bar = ready.index(s)
                mbarrier.expect(bar, w_d.block_type.nbytes + s_d.block_type.nbytes
                                + 2 * h_d.block_type.nbytes)
                tma.async_copy_global_to_shared(w_d, [run * (I // 2) + k * 64, 0], bar,
                                                w_buf.index(s))
                tma.async_copy_global_to_shared(s_d, [run * (I // 16) + k * 8, 0], bar,
                                                s_buf.index(s))
                if k == 0:
                    _wait_rows(count_ptr, num_slots, sorted_pair_ptr, num_pairs, slot0, writers,
                               TILES, BLOCK_M, False, 1)
                    _fence_proxy_async_global()
                tma.async_copy_global_to_shared(h_d, [slot0, k * 128], bar, h_buf.index(2 * s))
                tma.async_copy_global_to_shared(h_d, [slot0, k * 128 + 64], bar,
                                                h_buf.index(2 * s + 1))
                i += 1
        item = after
    _end_tickets(ticket, item, num_items, ids, empty, ready, i, STAGES)


@gluon.jit
def _ticket_consumer(sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, empty, ready,
                     w_buf, s_buf, h_buf, ids, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                     TILES: gl.constexpr, BLOCK_M: gl.constexpr):
    """`_consumer` without `OVERLAP` (h rows from the ring) over the items the producer
    tagged, in its order, until the tag -1."""
    i = 0  # K-steps consumed so far
    tag = _tag(ids, ready, i, STAGES)
    while tag >= 0:
        item, expert = tag // 1024, tag % 1024
        slot0, tile = _place(item, TILES, BLOCK_M)
        alpha = gl.load(alpha_ptr + expert) * 128.0  # * 2^7: the decode's w * 2^-7
        pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)))
        acc = gl.zeros([128, 8], gl.float32, MMA)
        for _ in gl.static_range(KSTEPS):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            words, codes = _chunk(w_buf.index(s), s_buf.index(s))
            h_even = h_buf.index(2 * s).permute([1, 0]).load(H_OP)
            h_odd = h_buf.index(2 * s + 1).permute([1, 0]).load(H_OP)
            fence_async_shared()
            mbarrier.arrive(empty.index(s), count=1)
            acc = _mma_chunk(words, codes, h_even, h_odd, acc)
            i += 1
        cols = tile * 128 + gl.arange(0, 128, gl.SliceLayout(1, MMA))
        _store_tile(y_ptr, pairs, stride_y, cols, (acc * alpha).to(gl.bfloat16),
                    pairs < num_pairs)
        tag = _tag(ids, ready, i, STAGES)


@gluon.jit
def gdc_wait():
    """PDL: wait until the previous kernel has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def gdc_launch_dependents():
    """PDL: let the next kernel launch (its programs wait in their own `gdc_wait`)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The (empty, ready) mbarriers of a STAGES-deep ring, initialized (one arrival each)."""
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(ready.index(s), count=1)
    return empty, ready


@gluon.jit
def _down_gluon_kernel(w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, alpha_ptr, y_ptr,
                       num_items, num_pairs, shared_id, stride_y, h_ptr, stride_h, count_ptr,
                       num_slots, writers, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                       TILES: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
                       BLOCK_M: gl.constexpr, OVERLAP: gl.constexpr = False,
                       PDL: gl.constexpr = False, TICKETS: gl.constexpr = False):
    """`OVERLAP`: launched while gate/up runs (with PDL: `PDL`, which also lets the next
    kernel launch at once); the consumers wait per routing block for its h rows
    (`moe_overlap`'s counters in `count_ptr`, `writers` gate/up programs per block) and load
    them from global memory instead of the producer's TMA copies. `TICKETS` (with `OVERLAP`):
    items from the counter `count_ptr[2 * num_slots]` (zero between launches) in turn, and the
    producer waits for the rows and copies them."""
    if PDL:
        gdc_launch_dependents()
    w_buf = gl.allocate_shared_memory(w_d.dtype, [STAGES] + w_d.block_type.shape, w_d.layout)
    s_buf = gl.allocate_shared_memory(s_d.dtype, [STAGES] + s_d.block_type.shape, s_d.layout)
    h_buf = gl.allocate_shared_memory(h_d.dtype, [2 * STAGES] + h_d.block_type.shape,
                                      h_d.layout)
    empty, ready = ring_barriers(STAGES)
    if TICKETS:  # (with OVERLAP: the producer waits for gate/up's rows and copies them)
        ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], TAGS)  # one tag per ring slot
        gl.warp_specialize([
            (_ticket_consumer, (sorted_pair_ptr, alpha_ptr, y_ptr, num_pairs, stride_y, empty,
                                ready, w_buf, s_buf, h_buf, ids, STAGES, KSTEPS, TILES,
                                BLOCK_M)),
            (_ticket_producer, (w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, count_ptr,
                                num_slots, writers, num_items, num_pairs, shared_id, empty,
                                ready, w_buf, s_buf, h_buf, ids, STAGES, KSTEPS, TILES, I, H,
                                BLOCK_M)),
        ], [1], [40])
    else:  # program p's items p, p + grid, ... (the producer and the consumers alike)
        gl.warp_specialize([
            (_consumer, (expert_of_block_ptr, sorted_pair_ptr, alpha_ptr, y_ptr, num_items,
                         num_pairs, shared_id, stride_y, empty, ready, w_buf, s_buf, h_buf,
                         h_ptr, stride_h, count_ptr, num_slots, writers, STAGES, KSTEPS, TILES,
                         BLOCK_M, OVERLAP)),
            (_producer, (w_d, s_d, h_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
                         num_pairs, shared_id, empty, ready, w_buf, s_buf, h_buf, STAGES,
                         KSTEPS, TILES, I, H, BLOCK_M, OVERLAP)),
        ], [1], [40])
    if PDL:  # finish only after the kernel before (the shared expert's down parts) has: the
        # kernel after (the combine) waits for this one alone
        gdc_wait()


def shared_layouts() -> tuple[object, object, object]:
    """TMA boxes' shared layouts: weights uint8 [64, 128] (128-byte swizzle), codes int32
    [8, 32] unswizzled (read as bytes), h bf16 [8, 64]."""
    return (gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            gl.NVMMASharedLayout.get_default_for([8, 64], gl.bfloat16))


def launch_down_gluon(h: torch.Tensor, sorted_pair: torch.Tensor, expert_of_block: torch.Tensor,
                      words: torch.Tensor, codes: torch.Tensor, alpha: torch.Tensor,
                      y: torch.Tensor, num_pairs: int, shared_id: int,
                      count: torch.Tensor | None = None, num_slots: int = 0, writers: int = 0,
                      pdl: bool = False) -> None:
    """y[pair] = bf16(alpha[e] * h[slot] @ down[e]^T) for every routed pair of the routing
    (`sorted_pair`, `expert_of_block`: blocks of 16, 32 or 64 slots, cut into 8-slot parts;
    blocks of expert `shared_id` skipped). h bf16 `[S, I]` with `H_EVEN_ODD` columns; words
    uint8 `[E, H, I/2]` and codes uint8 `[E, H, I/16]` (v7's stored forms viewed as bytes),
    alpha fp32 `[E]`, y bf16 `[P, H]`.
    `count` (`moe_overlap.counters`, `num_slots` slots, `writers` gate/up programs per routing
    block): the kernel waits per block for gate/up's rows (launched during gate/up, with PDL
    if `pdl`); None: gate/up has finished. Launch it after the shared expert's down parts: with
    PDL it ends with `griddepcontrol.wait`, so that its completion implies theirs (the combine
    that follows waits for this kernel only). With `count`, `TICKETS` (read at each launch)
    hands the items out by the ticket counter after the slots' (`2 * num_slots + 1` counters,
    `moe_overlap.counters(device, num_slots + 1)`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tickets = TICKETS and count is not None
    if tickets and count.numel() < 2 * num_slots + 1:
        raise ValueError(f"nvfp4_moe: the Gluon down kernel with tickets needs "
                         f"{2 * num_slots + 1} counters (`moe_overlap.counters(device, "
                         f"num_slots + 1)`), got {count.numel()}")

    E, H, half_i = words.shape
    I = 2 * half_i
    w_l, s_l, h_l = shared_layouts()
    w_d = TensorDescriptor.from_tensor(words.view(-1, 128), [64, 128], w_l)
    s_d = TensorDescriptor.from_tensor(codes.view(torch.int32).view(-1, 32), [8, 32], s_l)
    h_d = TensorDescriptor.from_tensor(h, [8, 64], h_l)
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    items = expert_of_block.shape[0] * (block_m // 8) * (H // 128)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    _down_gluon_kernel[(sms * PROGRAMS_PER_SM,)](
        w_d, s_d, h_d, expert_of_block, sorted_pair, alpha, y, items, num_pairs, shared_id,
        y.stride(0), h, h.stride(0), expert_of_block if count is None else count, num_slots,
        writers, STAGES=STAGES, KSTEPS=I // 128, TILES=H // 128, I=I, H=H, BLOCK_M=block_m,
        OVERLAP=count is not None, PDL=pdl, TICKETS=tickets, num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if pdl else {}))
