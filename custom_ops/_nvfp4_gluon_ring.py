"""How the consumer warps of the Gluon NVFP4 kernels hand a ring slot back to the producer warp
(`_nvfp4_gate_up_gluon`, `_nvfp4_moe_gluon`, `_nvfp4_down_gluon`).

`DLMC_NVFP4_RING_EMPTY` (read at import):
- "mbarrier": the slot's `empty` mbarrier (`ring_barriers`). Gluon lowers the consumers'
  `mbarrier.arrive` to a `bar.sync` of the four consumer warps followed by one thread's
  arrival, so every K-step holds each consumer warp until the slowest has read the slot
  (session 27's Nsight Compute run: 134 of the K-step loop's ~2400 stall samples there).
- "named": named barrier `EMPTY_BARRIER + slot` (hardware barriers 8.., none of which Triton's
  warp specialization uses: it takes 0 and 1). Each consumer thread signals with `bar.arrive`,
  which does not wait; the producer warp waits with `bar.sync` before it refills the slot (from
  its `STAGES`-th fill on), and at its end for the consumers' last arrivals
  (`drain_slots`), so that no barrier is left part-way. Both count the 4 consumer warps and the
  producer warp (160 threads). `bar.arrive` orders the thread's earlier shared-memory reads
  before the producer's wait returns, as the mbarrier's arrival does; the proxy fence before
  it stays. ptxas moves arithmetic across a `bar.arrive`, so the slot's decode waits for a
  zero read back from shared memory after it (`release_slot`'s token).
  Session 28 (H200, routed experts): the first form, without the token, was bit for bit but
  slower, 92.2-92.3 against 88.7-89.1 µs per layer (gate/up 64.3 against 60.4 µs), with 14 of
  the K-step's MMAs ahead of the arrival in the SASS; the form with the token is not yet
  measured. Opt-in until it is.

Either way the data side (`ready`) is the mbarrier that the TMA copies complete; its wait keeps
Gluon's `bar.sync` (an inline-asm wait would need the barrier's shared address, which Gluon
does not expose).
"""

from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

__all__ = ["EMPTY_BARRIER", "NAMED_EMPTY", "RING_EMPTY", "drain_slots", "release_slot",
           "wait_slot"]

RING_EMPTY = os.environ.get("DLMC_NVFP4_RING_EMPTY", "mbarrier")
if RING_EMPTY not in ("named", "mbarrier"):
    raise ValueError(f"DLMC_NVFP4_RING_EMPTY={RING_EMPTY!r}: expected named or mbarrier")
NAMED_EMPTY = gl.constexpr(RING_EMPTY == "named")
EMPTY_BARRIER = gl.constexpr(8)  # named barrier of ring slot s: EMPTY_BARRIER + s (s < 8)


@gluon.constexpr_function
def _bar_asm(op: str, consumer_warps: int) -> str:
    """`bar.arrive` / `bar.sync` on the barrier in $1, counting the consumer warps and the
    producer warp."""
    return f"bar.{op} $1, {32 * (consumer_warps + 1)}; // dummy $0"


@gluon.jit
def _bar(ASM: gl.constexpr, bar_id, WARPS: gl.constexpr):
    """Every thread of a `WARPS`-warp partition runs `ASM` once (a replicated one-element
    tensor carries the barrier id)."""
    ids = gl.full([1], bar_id, gl.int32, gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.inline_asm_elementwise(ASM, "=r,r", [ids], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_slot(empty, i, STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr = 4):
    """The producer warp, before fill i of the ring: slot i % STAGES has been read."""
    s = i % STAGES
    if NAMED_EMPTY:
        gl.static_assert(STAGES <= 8, "named ring hand-back: barriers 8..15 hold 8 slots")
        if i >= STAGES:
            _bar(_bar_asm("sync", CONSUMER_WARPS), EMPTY_BARRIER + s, 1)
    else:
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)


@gluon.jit
def release_slot(empty, s, WARPS: gl.constexpr = 4):
    """The consumer warps, once they have read ring slot s into registers. Returns a zero for
    the slot's decode (`_mma_chunk`'s `token`): named, one read back from shared memory
    (`ring_barriers`' zeros) after the `bar.arrive`, so that ptxas, which moves arithmetic
    across the arrival (14 of a gate/up K-step's MMAs, and a zero made by arithmetic after it
    folds away), keeps the decode after it and the slot goes back early."""
    fence_async_shared()
    if NAMED_EMPTY:
        _bar(_bar_asm("arrive", WARPS), EMPTY_BARRIER + s, WARPS)
        zero = empty.index(s).load(gl.BlockedLayout([1], [32], [WARPS], [0]))
        token = gl.max(zero, axis=0)
    else:
        mbarrier.arrive(empty.index(s), count=1)
        token = 0
    return token


@gluon.jit
def drain_slots(fills, STAGES: gl.constexpr, TAGGED: gl.constexpr,
                CONSUMER_WARPS: gl.constexpr = 4):
    """The producer warp after its last fill (`fills` fills in all; `TAGGED`: the last of them
    is the end tag, which the consumers read without handing back): waits out the consumers'
    arrivals that no later `wait_slot` took, the last `STAGES` handed-back fills at most."""
    if NAMED_EMPTY:
        handed_back = fills - TAGGED
        for j in range(gl.maximum(handed_back - STAGES + TAGGED, 0), handed_back):
            _bar(_bar_asm("sync", CONSUMER_WARPS), EMPTY_BARRIER + j % STAGES, 1)
