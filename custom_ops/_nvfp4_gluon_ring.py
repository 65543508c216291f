"""How the consumer warps of the Gluon NVFP4 kernels hand a ring slot back to the producer warp
(`_nvfp4_gate_up_gluon`, `_nvfp4_down_gluon`, `_nvfp4_shared_items`).

Each ring slot has an `empty` mbarrier (`_nvfp4_gluon_parts.ring_barriers`): the consumers
arrive on it once they have read the slot into registers (`release_slot`), and the producer waits
on it before it fills the slot again (`wait_slot`). The data side (`ready`) is the mbarrier that
the slot's TMA copies complete.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

__all__ = ["release_slot", "wait_slot"]


@gluon.jit
def wait_slot(empty, i, STAGES: gl.constexpr):
    """The producer warp, before fill i of the ring: slot i % STAGES has been read."""
    s = i % STAGES
    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)


@gluon.jit
def release_slot(empty, s):
    """The consumer warps, once they have read ring slot s into registers."""
    fence_async_shared()
    mbarrier.arrive(empty.index(s), count=1)
