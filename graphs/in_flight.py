"""Rounds in flight: the decode loop queues round r + 1 before it reads round r's "done" flag.

A round's one host sync (is the block done?) used to stop the device after every round: the
host read the flag, then launched the next replay, so the device sat idle for the graph's
launch latency each round (the gap between `dlmc bench round`'s "host read" and "queued"
times). With a round in flight the host reads round r's flag while round r + 1 is already
queued behind it.

Round r + 1 may find the block already finished. It then must change nothing, so the queued
round is *guarded*: it runs only while `buf.done` is False when it starts on the device. In a
CUDA graph the guard is a conditional node (CUDA 12.4+, `CUDAGraph.begin_capture_to_if_node`):
a one-thread kernel turns `~done` into the node's condition, and a round queued past the end of
its block costs that kernel alone. Outside graphs the guard reads the flag on the host.

`DoneReads` copies each queued round's flag into its own pinned host slot (the next round
overwrites `buf.done`), so the host can read round r's flag while round r + 1 runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dlmc.errors import ConfigError

SLOTS = 4  # host slots for done flags: a slot is reused only after it has been read


def guarded_capture_problem() -> str | None:
    """Why this torch / CUDA build cannot capture a guarded round (None: it can)."""
    version = torch.version.cuda
    if version is None:
        return "torch is not a CUDA build"
    major, minor = (int(p) for p in version.split(".")[:2])
    if (major, minor) < (12, 4):
        return f"CUDA graph conditional nodes need CUDA 12.4 or later (torch built with {version})"
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return f"torch {torch.__version__} has no CUDA graph conditional nodes"
    return None


@contextlib.contextmanager
def run_if_not(graph: torch.cuda.CUDAGraph, flag: torch.Tensor, scratch: torch.Tensor
               ) -> Iterator[None]:
    """Inside `graph`'s capture: what is captured in the body runs only while the device's
    bool `flag` `[]` is False when the graph reaches it (`scratch`: a bool `[]` CUDA tensor of
    the caller's, written with `~flag` first; it must outlive the graph)."""
    problem = guarded_capture_problem()
    if problem:
        raise ConfigError(f"a guarded round (rounds in flight) cannot be captured: {problem}; "
                          "pass lookahead=False")
    torch.logical_not(flag, out=scratch)
    graph.begin_capture_to_if_node(scratch)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


class DoneReads:
    """Host reads of a device bool flag `[]` as it stands after each queued round.

    `queue()` (after a round is queued) copies the flag into a free pinned slot and records an
    event; `read(slot)` waits for that event only, not for rounds queued after it."""

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag
        cuda = flag.is_cuda
        self.host = torch.zeros(SLOTS, dtype=torch.bool, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(SLOTS)]
        self.pending: list[int] = []  # slots queued, not yet read, oldest first
        self.free = list(range(SLOTS))

    def queue(self) -> int:
        """The flag after everything queued so far, into a slot; returns the slot."""
        if not self.free:
            raise RuntimeError(f"more than {SLOTS} done flags queued without a read")
        slot = self.free.pop(0)
        self.host[slot].copy_(self.flag, non_blocking=True)
        event = self.events[slot]
        if event is not None:
            event.record()
        self.pending.append(slot)
        return slot

    def read(self, slot: int) -> bool:
        """The flag copied into `slot` (waits for that copy); frees the slot."""
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        value = bool(self.host[slot])
        self.pending.remove(slot)
        self.free.append(slot)
        return value

    def drop(self) -> None:
        """Forget the slots not read (a block left early): they are free again."""
        self.free.extend(self.pending)
        self.pending.clear()
