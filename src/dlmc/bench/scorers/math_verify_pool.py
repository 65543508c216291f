"""math-verify in worker processes with a per-item timeout.

math-verify's own timeouts use ``signal.alarm``, which works only in a process's main thread, and a
pathological expression can still hang sympy. So every check runs in the main thread of a worker
process (`dlmc.bench.scorers._math_worker`, started with ``python -m`` so that the caller's
``__main__`` is never re-imported); the parent waits on its stdout with a timeout and kills (then
restarts) a worker that does not answer. Threads in the parent only wait on pipes; no
verification runs in them.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

DEFAULT_TIMEOUT_S = 10.0
_STARTUP_TIMEOUT_S = 120.0  # importing sympy + math-verify in a fresh process


@dataclass(frozen=True)
class VerifyResult:
    """One math-verify check: ``equivalent`` is false on error or timeout, with the reason."""

    equivalent: bool
    reason: str = ""


class _Worker:
    """One worker process (``python -m dlmc.bench.scorers._math_worker``), started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def ask(self, gold: str, candidate: str, timeout_s: float) -> VerifyResult:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps([gold, candidate]).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            self.stop()
            return VerifyResult(False, "math-verify worker died")
        line = _read_line(proc.stdout.fileno(), time.monotonic() + timeout_s)
        if line is None:
            self.stop()
            return VerifyResult(False, f"math-verify timed out after {timeout_s:g} s")
        if not line:
            self.stop()
            return VerifyResult(False, "math-verify worker died")
        equivalent, error = json.loads(line)
        return VerifyResult(bool(equivalent), str(error))

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dlmc.bench.scorers._math_worker"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
        )
        assert self._proc.stdout is not None
        ready = _read_line(self._proc.stdout.fileno(), time.monotonic() + _STARTUP_TIMEOUT_S)
        if not ready:
            self.stop()
            raise RuntimeError("the math-verify worker did not start: is math-verify installed?")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None


def _read_line(fd: int, deadline: float) -> bytes | None:
    """Read one line from ``fd`` by ``deadline``: the line, ``b""`` at EOF, ``None`` on timeout."""
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


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
