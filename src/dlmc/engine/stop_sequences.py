"""Stop sequences (OpenAI's and vLLM's `stop`): an answer's text as its blocks finish, cut
where a stop sequence appears. The sequence is not part of the text; the answer's ids end with
the id that completes it. Text that may begin a stop sequence is held back until a later block
shows whether it does, so no text past a stop is ever sent.

The stop that ends the answer is the one complete first in the text (the earliest end; of two
ending at the same character, the longer), as when text is checked token by token. So the cut
does not depend on how the text falls into blocks: a stop found in one block is final, since
one still incomplete at the block's end would end later."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dlmc.errors import ConfigError


def checked_stops(stop: Any) -> tuple[str, ...]:
    """`stop` (None, a string or a list of strings) as a tuple of distinct sequences."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ConfigError(f"stop: expected a string or a list of strings, got {stop!r}")
    if any(s == "" for s in items):
        raise ConfigError("stop: a stop sequence must not be empty")
    return tuple(dict.fromkeys(items))


class AnswerText:
    """The text of an answer's ids as blocks are added. `decode(ids)` is the tokenizer's text
    of answer ids. With `stops`, `add` returns only text that cannot begin a stop sequence and
    ends the answer at the first one complete (`stop`, `text`, `ids` then hold the cut
    answer)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # the text of `ids`, without an incomplete character at the end
        self.sent = 0  # characters of `text` returned by `add` / `flush`
        self.stop: str | None = None  # the stop sequence that ended the answer

    def add(self, block_ids: Sequence[int]) -> tuple[tuple[int, ...], str]:
        """The ids of a finished block that belong to the answer (all, or those up to the one
        completing a stop sequence) and the text that may be sent now."""
        if self.stop is not None:
            return (), ""
        before = len(self.ids)
        self.ids.extend(block_ids)
        self.text = self.decode(self.ids).rstrip("\ufffd")  # hold an incomplete character back
        found = self._first_stop()
        if found is not None:
            at, self.stop = found
            self.ids = self.ids[: self._ids_through(at + len(self.stop), before)]
            self.text = self.text[:at]
            return tuple(self.ids[before:]), self._send(at)
        return tuple(block_ids), self._send(len(self.text) - self._held())

    def flush(self) -> str:
        """The text still held back, once the answer has ended without a stop sequence."""
        return "" if self.stop is not None else self._send(len(self.text))

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        """(index, sequence) of the stop sequence complete first in the text not yet sent
        (none can begin in text already sent: `_held` keeps every possible start back); of
        two that end together, the longer."""
        hits = [(at, s) for s in self.stops if (at := self.text.find(s, self.sent)) >= 0]
        return min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0])) if hits else None

    def _held(self) -> int:
        """Characters at the end of the text that are the start of some stop sequence."""
        tail = self.text[self.sent :]
        longest = max((len(s) for s in self.stops), default=1) - 1
        for n in range(min(longest, len(tail)), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0

    def _ids_through(self, end: int, low: int) -> int:
        """The fewest ids whose text reaches character `end` (more than `low`: the ids
        before this block did not complete the sequence)."""
        lo, hi = low + 1, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(self.ids[:mid]).rstrip("\ufffd")) >= end:
                hi = mid
            else:
                lo = mid + 1
        return hi
