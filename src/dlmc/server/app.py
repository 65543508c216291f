"""The HTTP server: `create_app(llm, settings)` builds the FastAPI app.

Endpoints: `POST /generate` (dlmc's own, streaming by default), the OpenAI-compatible
`POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models`, `POST /tokenize`
and `POST /detokenize`, `GET /health`, `GET /metrics` (Prometheus, metrics.py) and
`GET /version`; with an API key, every route but `/health` and `/metrics` wants it (auth.py).
Requests decode one at a time on one engine thread (see engine_worker.py); each is read (at
most `max_body_bytes`), parsed and encoded by its handler off the event loop before it is queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlmc.errors import ConfigError
from dlmc.results import BlockChunk, GenerateResult
from dlmc.server.auth import ApiKeyCheck
from dlmc.server.context import ServerContext
from dlmc.server.engine_worker import EngineWorker, Prepared
from dlmc.server.handling import (
    DEFAULT_MAX_BODY_BYTES,
    EventStream,
    RequestPreparer,
    api_error,
    error_response,
    off_loop,
    read_body,
    run_to_end,
    sse,
)
from dlmc.server.metrics import CONTENT_TYPE, ServerMetrics
from dlmc.server.openai_compat import add_openai_routes
from dlmc.server.schemas import ApiError, GenerateRequest, parse_body
from dlmc.server.tokens import add_token_routes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """How the server runs. `decode_defaults`: `LLM.stream` decoding arguments applied to
    every request unless it gives its own (`edit_threshold: None` disables edits)."""

    model_name: str | None = None  # the id /v1/models reports (default: the LLM's model id)
    queue_size: int = 16  # requests that may wait while one decodes
    request_timeout_s: float = 600.0  # per request, waiting in the queue included
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies are answered 413
    decode_defaults: Mapping[str, Any] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # every route but /health wants it
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers ("*": any)

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                                or not key.isprintable() or not key.isascii()):
            raise ConfigError("api_key: expected printable ASCII without surrounding spaces")
        for origin in self.allowed_origins:
            if origin != "*" and not (origin.startswith(("http://", "https://"))
                                      and "/" not in origin.split("://", 1)[1]):
                raise ConfigError(f"allowed_origins: {origin!r} is not an origin such as "
                                  "'http://localhost:3000' (scheme and host, no path) or '*'")
        if not isinstance(self.queue_size, int) or self.queue_size < 0:
            raise ConfigError(f"queue_size: expected an integer >= 0, got {self.queue_size!r}")
        if not self.request_timeout_s > 0:
            raise ConfigError(
                f"request_timeout_s: expected a number > 0, got {self.request_timeout_s!r}"
            )
        size = self.max_body_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"max_body_bytes: expected an integer >= 1, got {size!r}")


def create_app(llm: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `llm` (an `LLM`, already loaded). The engine thread starts and stops
    with the app's lifespan."""
    settings = settings or ServerSettings()
    preparer = RequestPreparer(llm, settings.decode_defaults)
    llm.decode_settings(**preparer.defaults)  # bad defaults fail here, not per request
    preparer.load_tokenizer()
    model_name = settings.model_name or str(llm.model_id)
    worker = EngineWorker(llm, settings.queue_size, settings.request_timeout_s)
    metrics = ServerMetrics(model_name, worker.snapshot)
    worker.on_finished = metrics.observe_finished
    ctx = ServerContext(
        llm=llm,
        worker=worker,
        preparer=preparer,
        model_name=model_name,
        created=int(time.time()),
        max_body_bytes=settings.max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.worker.start()
        try:
            yield
        finally:
            ctx.worker.stop()

    app = FastAPI(title="dlmc", summary="diffusion LM server", lifespan=lifespan)
    app.state.dlmc = ctx
    if settings.api_key is not None:
        app.add_middleware(ApiKeyCheck, key=settings.api_key)
    if settings.allowed_origins:  # added last: outermost, so preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    _add_error_handlers(app)
    _add_dlmc_routes(app, ctx)
    _add_monitoring_routes(app, metrics)
    add_openai_routes(app, ctx)
    add_token_routes(app, ctx)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, message, param=None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, f"invalid request: {exc.errors()[0]['msg']}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(exc)


def _add_dlmc_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        """`{"status": "ok", "model", "max_context", "queue": {running, waiting, queue_size},
        "requests": {completed, cancelled, failed, timed_out, rejected}}`."""
        snap = ctx.worker.snapshot()
        queue = {k: snap.pop(k) for k in ("running", "waiting", "queue_size")}
        return {
            "status": "ok",
            "model": ctx.model_name,
            "max_context": ctx.llm.max_context,
            "queue": queue,
            "requests": snap,
        }

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> Response:
        """Generate from `{"messages": [...]}` or `{"prompt": "..."}`; optional
        `max_new_tokens`, `threshold`, `edit_threshold` (null: no edits), `temperature`,
        `top_k`, `top_p`, `seed`, `stop` (a string or a list), `stream` (default true), and
        DiffusionGemma's sampler settings.

        Streamed as server-sent events (`text/event-stream`), one `data: <json>` line and a
        blank line per event, in order:
        `{"type": "block", "block_index": n, "text": "...", "token_ids": [...]}` each time
        a block is final (text is what that block adds), then
        `{"type": "done", "text": full, "tokens": n, "prompt_tokens": n, "forwards": n,
        "total_forwards": n, "tokens_per_forward": x, "tokens_per_second": y,
        "elapsed_s": s, "blocks": n, "finish_reason": "stop"|"length", "stop_reason": the
        stop sequence or null}`. With stop sequences, a last `block` event without token ids
        may carry text held back while it could have begun one.
        A failure after the stream has started (e.g. the request timeout) ends it with
        `{"type": "error", "error": {"message", "type", "param", "code"}}`.
        With `"stream": false` the answer is the `done` object alone.
        """
        try:
            raw = await read_body(request, ctx.max_body_bytes)
            body, prepared = await off_loop(_prepare_generate, ctx, raw)
            job = ctx.worker.submit(prepared)
            if not body.stream:
                done = await run_to_end(ctx.worker, job, request)
                return JSONResponse(done_event(done.result))
        except Exception as exc:
            return error_response(exc)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in ctx.worker.events(job):
                    if isinstance(event, BlockChunk):
                        yield sse(block_event(event))
                    else:
                        yield sse(done_event(event.result))
            except Exception as exc:
                yield sse({"type": "error", **api_error(exc).body()})

        return EventStream(events(), on_close=job.cancel)


def _add_monitoring_routes(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.get("/metrics", response_model=None)
    async def prometheus_metrics() -> Response:
        """Prometheus metrics (text format): queue gauges, request outcomes, tokens, forwards,
        latency histograms (see dlmc.server.metrics)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    try:
        installed = version("dlmc")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "unknown"

    @app.get("/version")
    async def dlmc_version() -> dict[str, str]:
        """`{"version": the installed dlmc's version}`."""
        return {"version": installed}


def _prepare_generate(ctx: ServerContext, raw: bytes) -> tuple[GenerateRequest, Prepared]:
    """Parse and check a /generate body and encode its prompt (on the handlers' pool)."""
    body = parse_body(GenerateRequest, raw)
    prompt, messages, prompt_field = body.engine_prompt()
    prepared = ctx.preparer.prepare(
        prompt=prompt,
        messages=messages,
        max_new_tokens=body.max_new_tokens,
        overrides=body.decode_overrides(),
        stop=body.stop,
        prompt_field=prompt_field,
    )
    return body, prepared


def block_event(chunk: BlockChunk) -> dict[str, Any]:
    return {
        "type": "block",
        "block_index": chunk.block_index,
        "text": chunk.text,
        "token_ids": list(chunk.token_ids),
    }


def done_event(result: GenerateResult) -> dict[str, Any]:
    return {
        "type": "done",
        "text": result.text,
        "tokens": len(result.token_ids),
        "prompt_tokens": len(result.prompt_token_ids),
        "forwards": result.num_forwards,
        "total_forwards": result.total_forwards,
        "tokens_per_forward": result.tokens_per_forward,
        "tokens_per_second": result.request_tps,
        "elapsed_s": result.elapsed_s,
        "blocks": result.blocks,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
