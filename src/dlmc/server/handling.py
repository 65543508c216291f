"""What every endpoint shares: turning a validated request into engine arguments (prompt
encoded, settings resolved, context checked), running it to the end or as an event stream,
and mapping failures to HTTP errors that name the field at fault."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from dlmc.engine.stop_sequences import checked_stops
from dlmc.errors import ConfigError, DlmcError
from dlmc.results import Done
from dlmc.server.engine_worker import (
    EngineWorker,
    Job,
    Prepared,
    QueueFull,
    RequestCancelled,
    RequestTimeout,
)
from dlmc.server.schemas import ApiError

T = TypeVar("T")
log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DEFAULT_MAX_BODY_BYTES = 1024 * 1024  # 1 MiB: far above a 32k-token prompt (~130 kB of English)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 past `limit` bytes: at once when Content-Length
    says so, else as soon as the bytes received pass it (the rest is never read)."""
    where = f"the server's limit of {limit} bytes (dlmc serve --max-body-bytes)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body: Content-Length {declared} exceeds {where}", param="body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body: larger than {where}", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` on the handlers' thread pool (not the event loop, not the engine thread):
    parsing and encoding a request there delays that request alone."""
    return await run_in_threadpool(fn, *args)


class RequestPreparer:
    """Checks a request against the loaded model before it is queued, so bad input is a 400
    at once (not an error after waiting in the queue). `prepare` runs on the handlers'
    thread pool, several requests at a time: encoding only reads the tokenizer."""

    def __init__(self, llm: Any, defaults: Mapping[str, Any]) -> None:
        self.llm = llm
        # None means "not given", except for edit_threshold where it disables edits
        self.defaults = {
            k: v for k, v in defaults.items() if v is not None or k == "edit_threshold"
        }

    def load_tokenizer(self) -> None:
        """Encode once before requests arrive: the first encode loads the tokenizer (and may
        reset its truncation), which concurrent first requests would race on."""
        with contextlib.suppress(DlmcError):  # a checkpoint without one serves nothing else
            self.llm.encode_prompt("Hi!")

    def prepare(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        max_new_tokens: int | None = None,
        overrides: Mapping[str, Any],
        stop: str | list[str] | None = None,
        prompt_field: str = "prompt",
        length_field: str = "max_new_tokens",
    ) -> Prepared:
        """Encode the prompt, resolve the settings (server defaults < request), and fit the
        answer into the model's context. `*_field` are the request's names for the prompt
        and the length limit, used in error messages."""
        ids = self.encode(prompt, messages, prompt_field)
        try:
            stops = checked_stops(stop)
        except ConfigError as exc:
            raise _input_error(exc) from None
        given = {**self.defaults, **overrides}
        if max_new_tokens is not None:
            given["max_new_tokens"] = max_new_tokens
        try:
            cfg = self.llm.decode_settings(**given)
        except ConfigError as exc:
            raise _input_error(exc) from None
        fits = self.llm.max_context // cfg.block_length * cfg.block_length - len(ids)
        if fits < 1:
            raise ApiError(
                400,
                f"{prompt_field}: the prompt is {len(ids)} tokens, which leaves no room for an "
                f"answer in the model's context of {self.llm.max_context} tokens",
                param=prompt_field,
            )
        if max_new_tokens is not None and max_new_tokens > fits:
            raise ApiError(
                400,
                f"{length_field}: {max_new_tokens} tokens after a prompt of {len(ids)} tokens "
                f"exceeds the model's context of {self.llm.max_context} (at most {fits} fit)",
                param=length_field,
            )
        limit = min(cfg.max_new_tokens, fits)  # a default limit shrinks to what fits
        settings = {**given, "max_new_tokens": limit}
        return Prepared(ids, settings | ({"stop": list(stops)} if stops else {}))

    def encode(self, prompt: str | None, messages: Any, prompt_field: str) -> list[int]:
        """The request's prompt ids; a prompt the tokenizer refuses or that encodes to no
        tokens is a 400 naming `prompt_field`."""
        try:
            ids = self.llm.encode_prompt(prompt, messages)
        except DlmcError as exc:
            raise ApiError(400, f"{prompt_field}: {exc}", param=prompt_field) from None
        if not ids:
            raise ApiError(400, f"{prompt_field}: encodes to no tokens", param=prompt_field)
        return ids


def _input_error(exc: DlmcError) -> ApiError:
    """A 400 naming the field the engine's message names (`option` or `field: ...`); the
    engine's "decoding option `x`: ..." reads "x: ..." as the other field errors do."""
    text = str(exc)
    named = re.search(r"`(\w+)`", text) or re.match(r"(\w+):", text)
    text = re.sub(r"^decoding option `(\w+)`: ", r"\1: ", text)
    return ApiError(400, text, param=named.group(1) if named else None)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP error for anything a request can end with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), kind="overloaded_error")
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), kind="timeout_error")
    if isinstance(exc, RequestCancelled):
        return ApiError(503, str(exc), kind="unavailable_error")
    if isinstance(exc, DlmcError):
        return _input_error(exc)
    log.error("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = api_error(exc)
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def sse(data: Any) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


async def run_to_end(worker: EngineWorker, job: Job, request: Request) -> Done:
    """Wait for the job's result; a client that disconnects meanwhile cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        async for event in worker.events(job):
            if isinstance(event, Done):
                return event
        raise RequestCancelled("the request ended without a result")  # pragma: no cover
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, job: Job, every_s: float = 0.2) -> None:
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(every_s)


class EventStream(StreamingResponse):
    """A `text/event-stream` response that calls `on_close` however it ends: finished, or
    the client disconnected (Starlette then stops iterating the body without closing it)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
