"""The pieces shared by the Gluon kernels of `dlmc::nvfp4_moe` (sm_90, kernel v7's stored
forms): `_nvfp4_gate_up_gluon` (the routed gate/up projection) and `_nvfp4_down_gluon` (the
routed down projection).

- Layouts for four consumer warps: the MMA's accumulator [128 weight rows, 8 slots] (`MMA`),
  the weights as its A operand (`W_OP`, read from a ring slot's 128-byte-swizzled chunk with
  `ldmatrix`: `WL2` -> `W4`) and the slots as B (`H_OP`), from `mma_layout`,
  `operand_layout`, `word_layout`, `chunk_layout` and `codes_layout` (which take the warp
  count, 4 or 8).
- Work items (`_place`, `_item`): an 8-slot part of a routing block and a 128-row N-tile; a part
  whose first slot is padding has no work.
- The decode and MMA of one ring slot (`_chunk`, `_decoded_tiles`, `_mma_chunk`: v7's asm,
  `w * scale * 2^-7`), the tile store (`_store_tile`).
- The ring (`ring_barriers`), its slots' item tags (`_tag_slot`, `_tag`, `_end_tickets`), the
  per-block waits on `moe_overlap`'s counters (`_wait_rows`), and the PDL and proxy-fence
  instructions (`gdc_wait`, `gdc_launch_dependents`, `_fence_proxy_async_global`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from dlmc.custom_ops._nvfp4_gluon_ring import wait_slot
from dlmc.custom_ops.nvfp4_scale_codes import PAIR_ADD, PAIR_MUL
from dlmc.custom_ops.nvfp4_words import DECODE_WORDS_ASM

__all__ = ["H_OP", "MMA", "TAGS", "W_OP", "check_item_tags", "chunk_rings",
           "gdc_launch_dependents", "gdc_wait", "ring_barriers", "shared_layouts", "tab_scalar"]

_ASM = gl.constexpr(DECODE_WORDS_ASM.value)
_PMUL, _PADD = gl.constexpr(PAIR_MUL), gl.constexpr(PAIR_ADD)


@gluon.constexpr_function
def mma_layout(warps: int) -> object:
    """The MMA's accumulator [128 weight rows, 8 slots]: `warps` consumer warps (4 or 8) split
    the weight rows."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, 8])


@gluon.constexpr_function
def operand_layout(index: int, warps: int) -> object:
    """The MMA's A (index 0: the weights [128 n, 64 k']) or B (1: the slots [64 k', 8])."""
    return gl.DotOperandLayout(operand_index=index, parent=mma_layout(warps), k_width=4)


@gluon.constexpr_function
def word_layout(warps: int) -> object:
    """A's elements as bytes [n 128, block 8, half 2, byte 4]: registers -> byte, n bit 3,
    block bits 1-2 (and with 4 warps n bit 6); lanes -> half, block bit 0, n bits 0-2;
    warps -> n bits 4-5 (and with 8 warps n bit 6)."""
    regs = [[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]]
    warp_bases = [[16, 0, 0, 0], [32, 0, 0, 0]]
    (regs if warps == 4 else warp_bases).append([64, 0, 0, 0])
    return gl.DistributedLinearLayout(
        reg_bases=regs, block_bases=[], shape=[128, 8, 2, 4], warp_bases=warp_bases,
        lane_bases=[[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]])


@gluon.constexpr_function
def chunk_layout(warps: int) -> object:
    """`word_layout`'s elements in a chunk's [64, 128] bytes (row r = weight rows 2r, 2r+1)."""
    regs = [[0, 1], [0, 2], [4, 0], [0, 16], [0, 32]]
    warp_bases = [[8, 0], [16, 0]]
    (regs if warps == 4 else warp_bases).append([32, 0])
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, 4], [0, 8], [0, 64], [1, 0], [2, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[64, 128])


@gluon.constexpr_function
def codes_layout(warps: int) -> object:
    """The block-scale codes [128 n, 8 blocks] as `word_layout` holds them."""
    return gl.SliceLayout(2, gl.SliceLayout(3, word_layout(warps)))


# The layouts for four consumer warps (the kernels' default)
MMA = gl.constexpr(mma_layout(4))
W_OP = gl.constexpr(operand_layout(0, 4))
H_OP = gl.constexpr(operand_layout(1, 4))
W4 = gl.constexpr(word_layout(4))
WL2 = gl.constexpr(chunk_layout(4))
CODES_L = gl.constexpr(codes_layout(4))
W_BYTES = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
TAG_L = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # the producer warp's tag store
TAGS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # a slot's tag: a rank-1 view


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
    _wait_live_rows(count_ptr, num_slots, block,
                    _live_parts(sorted_pair_ptr, num_pairs, block, BLOCK_M, WARPS), writers,
                    TILES, PER_PART)


@gluon.jit
def _wait_live_rows(count_ptr, num_slots, block, live, writers, TILES: gl.constexpr,
                    PER_PART: gl.constexpr = False):
    """`_wait_rows` for routing block `block` whose `live` 8-slot parts hold a pair."""
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
def _chunk(w_slot, s_slot, WARPS: gl.constexpr = 4):
    """One ring slot's weight chunk as bytes [128, 8, 2, 4] in `word_layout` (read with
    `ldmatrix` through the 128-byte swizzle) and its block-scale codes [128, 8]."""
    words = w_slot._reinterpret(gl.uint8, [64, 128], W_BYTES).load(chunk_layout(WARPS))
    words = gl.convert_layout(gl.reshape(words, [128, 8, 2, 4]), word_layout(WARPS))
    return words, s_slot._reinterpret(gl.uint8, [128, 8], PLAIN2).load(codes_layout(WARPS))


@gluon.jit
def _decoded_tiles(words, codes):
    """v7 words (bytes [n, 8, 2, 4], n 128 or a part of it) and their block-scale codes -> the
    low- and high-nibble bf16 tiles [n, 64 k'] (`w * scale * 2^-7`, exact)."""
    pair = codes.to(gl.int32) * _PMUL + _PADD
    pair = gl.broadcast(gl.expand_dims(gl.expand_dims(pair, 2), 3), words)[0]
    lo, hi = gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r,r,r", [words, pair],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.reshape(lo, [words.shape[0], 64]), gl.reshape(hi, [words.shape[0], 64])


@gluon.jit
def _mma_chunk(words, codes, b_even, b_odd, acc, WARPS: gl.constexpr = 4):
    """acc + a weight chunk (decoded, the MMA's A: low nibbles with the even-K B operand, high
    nibbles with the odd-K one)."""
    lo, hi = _decoded_tiles(words, codes)
    acc = mma_v2(gl.convert_layout(lo, operand_layout(0, WARPS)), b_even, acc)
    return mma_v2(gl.convert_layout(hi, operand_layout(0, WARPS)), b_odd, acc)


@gluon.jit
def _store_tile(base_ptr, rows, stride, cols, values, valid):
    """values [128 columns, 8 rows] (`MMA`) to base[rows[r] * stride + cols[c]] where valid[r]."""
    ptrs = base_ptr + gl.expand_dims(rows.to(gl.int64) * stride, 0) + gl.expand_dims(cols, 1)
    mask = gl.expand_dims(valid, 0) & gl.expand_dims(cols >= 0, 1)
    gl.store(ptrs, values, mask=mask)


@gluon.jit
def _tag_slot(ids, s, tag):
    """The producer writes ring slot s's item tag (`item * 1024 + expert`, -1: no more items)
    before the slot's arrival on `ready` (the same thread: the arrival releases it)."""
    ids.index(s).store(gl.full([1], tag, gl.int32, TAG_L))


@gluon.jit
def tab_scalar(tab, index):
    """Row `index` of a `[n, 1]` int32 table in shared memory, as a scalar (the producer
    warp; `_nvfp4_self_route`'s tables)."""
    return gl.max(tab.index(index).load(TAG_L), axis=0)


@gluon.jit
def _tag(ids, ready, i, STAGES: gl.constexpr):
    """The tag of ring slot i (waiting for the slot first; four consumer warps)."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return gl.max(ids.index(s).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)


@gluon.jit
def _end_tickets(ticket, item, total, ids, empty, ready, i, STAGES: gl.constexpr,
                 TICKETS: gl.constexpr = True):
    """After the last item (`TICKETS`: every program has taken one ticket past the items, and
    the last of those resets the counter `ticket`): a slot tagged -1 ends the consumers'
    loop."""
    if TICKETS:  # noqa: SIM102 (a static condition around a runtime one)
        if item == total + gl.num_programs(0) - 1:
            gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
    s = i % STAGES
    wait_slot(empty, i, STAGES)
    _tag_slot(ids, s, -1)
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _fence_proxy_async_global():
    """Global memory that this thread has acquired (generic proxy) becomes visible to its
    TMA reads (async proxy)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


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
def chunk_rings(g_d, u_d, gs_d, us_d, STAGES: gl.constexpr):
    """`STAGES`-deep rings of four TMA boxes (gate and up chunks, then their codes), allocated
    in that order: (g_buf, u_buf, gs_buf, us_buf)."""
    g_buf = gl.allocate_shared_memory(g_d.dtype, [STAGES] + g_d.block_type.shape, g_d.layout)
    u_buf = gl.allocate_shared_memory(u_d.dtype, [STAGES] + u_d.block_type.shape, u_d.layout)
    gs_buf = gl.allocate_shared_memory(gs_d.dtype, [STAGES] + gs_d.block_type.shape, gs_d.layout)
    us_buf = gl.allocate_shared_memory(us_d.dtype, [STAGES] + us_d.block_type.shape, us_d.layout)
    return g_buf, u_buf, gs_buf, us_buf


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr = 1):
    """The (empty, ready) mbarriers of a STAGES-deep ring, initialized (one arrival each, or
    `EMPTY_ARRIVALS` consumer partitions on empty; `_nvfp4_gluon_ring`)."""
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=EMPTY_ARRIVALS)
        mbarrier.init(ready.index(s), count=1)
    return empty, ready


def check_item_tags(items: int, experts: int, kernel: str) -> None:
    """Ring slots tag their item as `item * 1024 + expert` in int32 (`_tag_slot`): `items` must
    stay below 2^21 and expert ids below 1024."""
    if items >= 2**21 or experts > 1024:
        raise ValueError(f"nvfp4_moe: {kernel} tags items as item * 1024 + expert in int32: "
                         f"{items} items (< 2^21) and {experts} experts (<= 1024) do not fit")


def shared_layouts() -> tuple[object, object, object]:
    """TMA boxes' shared layouts: weights uint8 [64, 128] (128-byte swizzle), codes int32
    [8, 32] unswizzled (read as bytes), h bf16 [8, 64]."""
    return (gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            gl.NVMMASharedLayout.get_default_for([8, 64], gl.bfloat16))
