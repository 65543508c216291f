"""math-verify in worker processes with a per-item timeout.

math-verify's own timeouts use ``signal.alarm``, which works only in a process's main thread, and a
pathological expression can still hang sympy. So every check runs in the main thread of a spawned
worker process; the parent waits on a pipe with a timeout and kills (then restarts) a worker that
does not answer. Threads in the parent only wait on pipes; no verification runs in them.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Self

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class VerifyResult:
    """One math-verify check: ``equivalent`` is false on error or timeout, with the reason."""

    equivalent: bool
    reason: str = ""


def _serve(conn: Connection) -> None:
    """Worker loop: receive ``(gold, candidate)``, answer ``(equivalent, error)``."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    while True:
        try:
            gold, candidate = conn.recv()
        except EOFError:
            return
        try:
            gold_parsed = parse("$" + gold + "$")
            if not gold_parsed:
                conn.send((False, f"math-verify could not parse the gold answer {gold!r}"))
                continue
            answer = parse(candidate, extraction_config=config)
            if not answer:
                conn.send((False, "math-verify could not parse the extracted answer"))
                continue
            conn.send((bool(verify(gold_parsed, answer)), ""))
        except Exception as exc:  # noqa: BLE001 - any failure of the checker scores wrong
            conn.send((False, f"math-verify raised {type(exc).__name__}: {exc}"))


class _Worker:
    """One spawned worker process and the parent's end of its pipe (started on first use)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Connection | None = None

    def ask(self, gold: str, candidate: str, timeout_s: float) -> VerifyResult:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        assert self._conn is not None
        self._conn.send((gold, candidate))
        if not self._conn.poll(timeout_s):
            self.stop()
            return VerifyResult(False, f"math-verify timed out after {timeout_s:g} s")
        try:
            equivalent, error = self._conn.recv()
        except EOFError:
            self.stop()
            return VerifyResult(False, "math-verify worker died")
        return VerifyResult(equivalent, error)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._proc = None


class MathVerifier:
    """A small pool of math-verify worker processes.

    ``verify(gold, candidate)`` checks ``verify(parse("$" + gold + "$"), parse(candidate, ...))``
    with boxed extraction first (gold goes first: math-verify is not symmetric).
    """

    def __init__(self, workers: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.timeout_s = timeout_s
        self._workers = [_Worker() for _ in range(workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)

    def verify(self, gold: str, candidate: str) -> VerifyResult:
        """Whether ``candidate`` (text with a ``\\boxed{}`` or an expression) equals ``gold``."""
        worker = self._idle.get()
        try:
            return worker.ask(gold, candidate, self.timeout_s)
        finally:
            self._idle.put(worker)

    def verify_many(self, pairs: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        """``verify`` over many ``(gold, candidate)`` pairs, spread over the workers."""
        with ThreadPoolExecutor(max_workers=len(self._workers)) as pool:
            return list(pool.map(lambda pair: self.verify(*pair), pairs))

    def close(self) -> None:
        """Stop the worker processes."""
        for worker in self._workers:
            worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier `score_math` uses by default (one worker, stopped at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default
