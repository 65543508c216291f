"""One engine, one decoding thread.

The engine is not thread-safe, so every request decodes on a single worker thread, one at a
time. The worker takes only `Prepared` requests (prompt encoded, settings resolved, answer fitted
to the context by the handlers, on other threads), so a slow or bad request never holds it.
Requests are admitted while fewer than `queue_size` wait (plus the one decoding);
beyond that `submit` raises `QueueFull`. A request of several parts (choices, prompts) is
admitted whole: its later parts queue behind the others without being refused. Each
request's events (a `BlockChunk` per finished block, then `Done`) travel back to the asyncio
handler that submitted it through that handler's own `asyncio.Queue`
(`loop.call_soon_threadsafe`).

Cancellation: `Job.cancel()` sets a flag that the engine polls before every round, so a
client that disconnects (or times out) frees the engine within one round; a cancelled job
still waiting in the queue is skipped without decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dlmc.results import BlockChunk, Done
from dlmc.server.metrics import FinishedRequest

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is full."""


class RequestTimeout(Exception):
    """The request ran past the server's request timeout (queueing included)."""


class RequestCancelled(Exception):
    """The request was cancelled by the server (it is shutting down)."""


@dataclass(frozen=True)
class Prepared:
    """A request ready to decode: its prompt as token ids and its `LLM.stream` settings
    (`max_new_tokens` included), already checked against the model and its context."""

    prompt_token_ids: list[int]
    settings: Mapping[str, Any]

    def __post_init__(self) -> None:
        text = {"prompt", "messages", "prompt_token_ids"} & set(self.settings)
        if text:
            raise ValueError(f"settings: {sorted(text)} belong in prompt_token_ids (encoded)")

    def stream_kwargs(self) -> dict[str, Any]:
        return {**self.settings, "prompt_token_ids": self.prompt_token_ids}


@dataclass(frozen=True)
class _Failure:
    error: BaseException


_END = object()  # the worker is finished with a job


@dataclass(eq=False)
class Job:
    """One request: what to decode, its deadline and its event channel."""

    request: Prepared
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the request has timed out
    admitted_at: float = field(default_factory=time.monotonic)
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the engine's next round (or skip the job if it has not started)."""
        self.cancelled.set()

    def should_stop(self) -> bool:
        """Polled by the engine before every round."""
        return self.cancelled.is_set() or time.monotonic() >= self.deadline

    def emit(self, item: Any) -> None:
        """Hand an event to the submitting handler (called from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


@dataclass
class WorkerCounts:
    """Requests by outcome since the server started."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0


class EngineWorker:
    """Runs `llm.stream` for submitted jobs on one thread, one job at a time."""

    def __init__(self, llm: Any, queue_size: int, request_timeout_s: float) -> None:
        self.llm, self.queue_size, self.request_timeout_s = llm, queue_size, request_timeout_s
        # Told of every job that decodes to its end, on the engine thread: the app sets it to
        # its metrics' recorder (which reads `snapshot`, so it is made after the worker).
        self.on_finished: Callable[[FinishedRequest], None] | None = None
        self.counts = WorkerCounts()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0  # waiting + decoding
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dlmc-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def cancel_all(self) -> None:
        """Refuse new jobs and cancel the running and waiting ones (their handlers answer
        "the server is shutting down"); does not wait."""
        with self._lock, self._jobs.mutex:
            self._stopping = True
            for job in [self._running, *self._jobs.queue]:
                if job is not None:
                    job.cancel()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel the running and waiting jobs and wait for the thread to end."""
        self.cancel_all()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def snapshot(self) -> dict[str, Any]:
        """Queue state and outcome counts (for /health)."""
        with self._lock:
            running = int(self._running is not None)
            return {
                "running": running,
                "waiting": self._admitted - running,
                "queue_size": self.queue_size,
                **vars(self.counts),
            }

    # -- handler side (event loop thread) --------------------------------------------------
    def submit(self, request: Prepared, admitted: bool = False) -> Job:
        """Queue a request; raises QueueFull when `queue_size` requests already wait, unless
        `admitted`: a later part (choice or prompt) of a request whose first part was
        admitted, which queues behind the others without being refused."""
        job = Job(request, asyncio.get_running_loop(), time.monotonic() + self.request_timeout_s)
        with self._lock:
            if self._stopping:
                raise RequestCancelled("the server is shutting down")
            if not admitted and self._admitted >= self.queue_size + 1:
                self.counts.rejected += 1
                raise QueueFull(
                    f"the server is busy: {self.queue_size} requests are already waiting; "
                    "retry later"
                )
            self._admitted += 1
            self._jobs.put(job)
        return job

    async def events(self, job: Job) -> AsyncIterator[BlockChunk | Done]:
        """Yield the job's BlockChunks and its Done; raise RequestTimeout past the deadline,
        the engine's exception if it failed. Leaving early cancels the job."""
        try:
            while True:
                remaining = job.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(job.events.get(), timeout=max(remaining, 0.0))
                except TimeoutError:
                    raise self._timeout(job) from None
                if item is _END:
                    raise RequestCancelled("the server is shutting down")
                if isinstance(item, _Failure):
                    raise item.error
                if isinstance(item, Done) and item.result.finish_reason == "cancelled":
                    if time.monotonic() >= job.deadline:
                        raise self._timeout(job)
                    raise RequestCancelled("the server is shutting down")
                yield item
                if isinstance(item, Done):
                    return
        finally:
            job.cancel()  # no-op once finished; frees the engine if the handler gave up

    def _timeout(self, job: Job) -> RequestTimeout:
        job.cancel()
        with self._lock:
            self.counts.timed_out += 1
        return RequestTimeout(
            f"the request ran past the server's request timeout of {self.request_timeout_s:g} s"
        )

    # -- worker side (the engine thread) ---------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._running = job
            last = None
            try:
                last = self._decode(job)
            finally:
                with self._lock:
                    self._running = None
                    self._admitted -= 1
                if last is not None:  # after the accounting: a handler that answers on it
                    job.emit(last)  # (and a health check after that) sees the engine free
                job.emit(_END)

    def _decode(self, job: Job) -> Done | _Failure | None:
        """Run the job, emitting its BlockChunks; return its last event (its Done or its
        failure, None if it was cancelled before it ran) for `_run` to emit."""
        if job.should_stop():  # the client left (or timed out) while it waited
            self._count("cancelled")
            return None
        started, first_block = time.monotonic(), None
        try:
            for event in self.llm.stream(**job.request.stream_kwargs(), cancel=job.should_stop):
                if isinstance(event, Done):  # the stream's last event
                    cancelled = event.result.finish_reason == "cancelled"
                    self._count("cancelled" if cancelled else "completed")
                    if not cancelled:
                        self._observe(_finished(job, started, first_block, event))
                    return event
                if first_block is None and isinstance(event, BlockChunk):
                    first_block = time.monotonic()
                job.emit(event)
        except Exception as exc:  # one bad request must not take the server down;
            self._count("failed")  # the handler reports it (a DlmcError 400, else 500)
            return _Failure(exc)
        return None

    def _observe(self, record: FinishedRequest) -> None:
        """Hand a finished request to `on_finished`; a failure there is logged, never the
        request's."""
        if self.on_finished is None:
            return
        try:
            self.on_finished(record)
        except Exception:
            log.exception("recording a finished request's metrics failed")

    def _count(self, outcome: str) -> None:
        with self._lock:
            setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)


def _finished(job: Job, started: float, first_block: float | None, done: Done) -> FinishedRequest:
    """The metrics' record of a job that decoded to its end."""
    r, t0 = done.result, job.admitted_at
    return FinishedRequest(
        queued_s=started - t0,
        first_block_s=None if first_block is None else first_block - t0,
        total_s=time.monotonic() - t0,
        prompt_tokens=len(r.prompt_token_ids),
        generated_tokens=len(r.token_ids),
        forwards=r.num_forwards,
        finish_reason=r.finish_reason,
    )
