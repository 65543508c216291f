"""The Gluon down kernel's own routing: with it the op launches no alignment at all.

`nvfp4_moe` with the routed experts in the Gluon kernels (the self-routed gate/up,
`_nvfp4_self_route`, then the down kernel, items by ticket) would otherwise launch `moe_align`
first: the gate/up programs route themselves beside it, but the down kernel reads its output.
Instead the gate/up launch comes first (`WAIT_FIRST`: it waits for the kernel before, then
routes, and its N-tile-0 items write their parts' pairs into `sorted_pair`), and the down
kernel works out the rest of each item's routing itself:

- before its warp-specialized part, the four default warps count the routing's pairs per
  expert (`gl.histogram` of `topk_ids`) and the ends of the experts' blocks of `BLOCK_M`
  slots in expert order (a scan) into shared memory: `moe_align.align_pairs`' layout, which
  `_nvfp4_self_route` also follows;
- the producer warp, per ticket, finds the item's block and its expert (the experts whose
  blocks end at or before it), whether its 8-slot part holds a pair and how many parts of
  the block do (`_wait_live_rows`); once it has acquired the block's counts, gate/up's pairs
  of the part are there for the consumers.

The kernel reads `topk_ids` without waiting for any launch: the gate/up launch before it has
waited for the routing's writer before letting it launch.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dlmc.custom_ops._nvfp4_gluon_parts import _place

__all__ = ["down_route_tables", "fill_down_tables", "self_item"]

_ROW = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # the tables (their rows' layout)
_WARP = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # the producer warp's vectors


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def down_route_tables(EXPERTS_PAD: gl.constexpr):
    """Shared tables `[EXPERTS_PAD]`: each expert's pair count and the end of its blocks."""
    counts = gl.allocate_shared_memory(gl.int32, [EXPERTS_PAD], _ROW)
    block_end = gl.allocate_shared_memory(gl.int32, [EXPERTS_PAD], _ROW)
    return counts, block_end


@gluon.jit
def fill_down_tables(ids_ptr, num_pairs, counts_tab, block_end_tab, BLOCK_M: gl.constexpr,
                     PAIRS_PAD: gl.constexpr, EXPERTS_PAD: gl.constexpr):
    """The tables of the routing `ids_ptr` (int32 or int64, `num_pairs` of them); four warps,
    before the warp-specialized part (whose partitions read them after its barrier)."""
    line: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pair = gl.arange(0, PAIRS_PAD, line)
    is_pair = pair < num_pairs
    ids = gl.load(ids_ptr + pair, mask=is_pair, other=0).to(gl.int32)
    counts = gl.histogram(ids, EXPERTS_PAD, mask=is_pair, layout=line)  # [E]
    counts_tab.store(counts)
    block_end_tab.store(gl.associative_scan((counts + BLOCK_M - 1) // BLOCK_M, 0, _add))


@gluon.jit
def self_item(counts_tab, block_end_tab, item, num_items, TILES: gl.constexpr,
              BLOCK_M: gl.constexpr, EXPERTS_PAD: gl.constexpr):
    """What the producer warp needs of work item `item` (`_nvfp4_gluon_parts._place`):
    (first slot, N-tile, expert, whether its part holds a pair, the block's parts that do)."""
    slot0, tile = _place(item, TILES, BLOCK_M)
    block = slot0 // BLOCK_M
    counts = counts_tab.load(_WARP)  # [E]
    ends = block_end_tab.load(_WARP)
    expert = gl.sum((ends <= block).to(gl.int32), axis=0)  # the expert whose blocks hold it
    mine = gl.arange(0, EXPERTS_PAD, _WARP) == expert
    count = gl.sum(gl.where(mine, counts, 0), axis=0)
    start = gl.sum(gl.where(mine, ends - (counts + BLOCK_M - 1) // BLOCK_M, 0), axis=0)
    in_block = gl.minimum(count - (block - start) * BLOCK_M, BLOCK_M)
    first = (block - start) * BLOCK_M + slot0 % BLOCK_M
    has_work = (item < num_items) & (block < gl.max(ends, axis=0)) & (first < count)
    return slot0, tile, expert, has_work, (in_block + 7) // 8


