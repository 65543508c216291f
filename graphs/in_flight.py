"""Rounds in flight: the decode loop queues round r + 1 before it reads round r's flags, where
round r cannot be the block's last.

A round's one host sync (is the block done?) used to stop the device after every round: the
host read the flag, then launched the next replay, so the device sat idle for the launch
latency each round (the gap between `dlmc bench round`'s "host read" and "queued" times).

Round r + 1 may be queued before round r's flags are read only if round r cannot end the
block, so that exactly the rounds of the one-by-one loop run (no round to undo or skip). The
LLaDA2.1 rule (`decide`, "joint") ends a block after round r when no editable mask was left
before it and it edited nothing, or when its post-fill rounds exceed `max_post`. Masks never
come back (a proposal is never the mask), so if masks were left after round r - 1, round r
has active masks and at most its own post-fill count of 1: it cannot end the block when
`max_post >= 1` (ORL: 16 refine steps). The host knows the masks left after round r - 1
(`RoundBuffers.masks_left`, read with its done flag), so while a block still has masks it
keeps one round queued ahead; in the post-fill rounds, whose end depends on edits, and under
the LLaDA2.0 rule (a round may commit every mask left), it reads each round before the next.

(A guard inside the graph, a CUDA graph conditional node, would let any round be queued; torch
2.11, the H200's, has no conditional-node capture.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

SLOTS = 4  # host slots for flag reads: a slot is reused only after it has been read


class FlagReads:
    """Host reads of device bool flags `[]` as they stand after each queued round.

    `queue()` (after a round is queued) copies the flags into a free pinned slot and records an
    event; `read(slot)` waits for that event only, not for rounds queued after it."""

    def __init__(self, *flags: torch.Tensor) -> None:
        self.flags = flags
        cuda = flags[0].is_cuda
        self.host = torch.zeros(SLOTS, len(flags), dtype=torch.bool, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(SLOTS)]
        self.pending: list[int] = []  # slots queued, not yet read, oldest first
        self.free = list(range(SLOTS))

    def queue(self) -> int:
        """The flags after everything queued so far, into a slot; returns the slot."""
        if not self.free:
            raise RuntimeError(f"more than {SLOTS} flag reads queued without a read")
        slot = self.free.pop(0)
        for column, flag in enumerate(self.flags):
            self.host[slot, column].copy_(flag, non_blocking=True)
        event = self.events[slot]
        if event is not None:
            event.record()
        self.pending.append(slot)
        return slot

    def read(self, slot: int) -> tuple[bool, ...]:
        """The flags copied into `slot` (waits for that copy); frees the slot."""
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        values = tuple(bool(v) for v in self.host[slot].tolist())
        self.pending.remove(slot)
        self.free.append(slot)
        return values

    def drop(self) -> None:
        """Forget the slots not read (a block left early): they are free again."""
        self.free.extend(self.pending)
        self.pending.clear()


def may_queue_ahead(algorithm: str, max_post: int) -> bool:
    """Whether a block's rounds may be queued one ahead while masks are left (module
    docstring): the LLaDA2.1 rule with at least one post-fill round allowed."""
    return algorithm == "joint" and max_post >= 1


def block_in_flight(
    reads: FlagReads, first: Callable[[], None], launch: Callable[[], None], ahead: bool,
    cancel: Callable[[], bool] | None = None, after_launch: Callable[[], Any] | None = None,
) -> tuple[int, bool]:
    """The rounds of one block, each launched before the last one is read where that one
    cannot end the block: `first()` queues round 1, `launch()` every later round; `reads`
    holds (done, masks_left) of each round; `ahead`: `may_queue_ahead` for the block, which
    starts with masks. `after_launch()` runs after every launch (a bench's timing event).
    Returns (rounds run, cancelled); the rounds run are the one-by-one loop's."""
    reads.drop()  # (slots a decode that raised midway left unread)
    queued: deque[int] = deque()  # rounds launched, not yet read

    def queue(round_fn: Callable[[], None]) -> None:
        round_fn()
        if after_launch is not None:
            after_launch()
        queued.append(reads.queue())

    queue(first)
    n = 0  # rounds read
    masks_left = True  # before round 1 (the caller's block starts with masks)
    while True:
        if cancel is not None and cancel():
            reads.drop()
            return n + len(queued), True
        if ahead and masks_left and len(queued) == 1:  # round n + 1 cannot end the block
            queue(launch)
        done, masks_left = reads.read(queued.popleft())
        n += 1
        if done:
            if queued:  # (cannot happen: round n + 1 was queued only if round n could not end)
                raise RuntimeError("a round was queued past the end of its block")
            return n, False
        if not queued:
            queue(launch)
