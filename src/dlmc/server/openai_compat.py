"""OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`.

Non-streaming answers are `chat.completion` / `text_completion` objects with `usage`.
Streaming (`"stream": true`) sends server-sent events `data: <chunk json>` — for chat a first
chunk with `delta.role`, then one chunk per finished block, then a chunk with
`finish_reason` and `usage` (and, with `stream_options.include_usage`, a chunk with empty
`choices` and `usage`, as OpenAI sends it) — and ends with `data: [DONE]`. An error after the
stream started is sent as `data: {"error": {...}}` before `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dlmc.results import BlockChunk, GenerateResult
from dlmc.server.context import ServerContext
from dlmc.server.engine_worker import Prepared
from dlmc.server.handling import (
    EventStream,
    api_error,
    error_response,
    off_loop,
    read_body,
    run_to_end,
    sse,
)
from dlmc.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Register the /v1 endpoints on `app`."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one model this server serves."""
        card = {"id": ctx.model_name, "object": "model", "created": ctx.created}
        return {"object": "list", "data": [{**card, "owned_by": "dlmc"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completion (messages rendered with the checkpoint's chat template)."""
        return await _complete(ctx, request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """OpenAI text completion of one raw prompt (no chat template)."""
        return await _complete(ctx, request, chat=False)


async def _complete(ctx: ServerContext, request: Request, chat: bool) -> Response:
    try:
        raw = await read_body(request, ctx.max_body_bytes)
        body, prepared = await off_loop(_prepare, ctx, raw, chat)
        job = ctx.worker.submit(prepared)
        head = _Head(ctx.model_name, chat)
        if not body.stream:
            done = await run_to_end(ctx.worker, job, request)
            return JSONResponse(head.whole(done.result))
    except Exception as exc:
        return error_response(exc)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        try:
            if chat:
                yield sse(head.chunk({"role": "assistant", "content": ""}))
            async for event in ctx.worker.events(job):
                if isinstance(event, BlockChunk):
                    if event.text:
                        yield sse(head.chunk({"content": event.text} if chat else event.text))
                    continue
                result = event.result
                last = head.chunk({} if chat else "", finish_reason=_finish(result))
                yield sse({**last, "usage": _usage(result)})
                if include_usage:
                    yield sse({**head.chunk(None), "choices": [], "usage": _usage(result)})
        except Exception as exc:
            yield sse(api_error(exc).body())
        yield sse("[DONE]")

    return EventStream(chunks(), on_close=job.cancel)


def _prepare(
    ctx: ServerContext, raw: bytes, chat: bool
) -> tuple[ChatCompletionRequest | CompletionRequest, Prepared]:
    """Parse and check a /v1 body and encode its prompt (on the handlers' pool)."""
    body: ChatCompletionRequest | CompletionRequest
    if chat:
        body = parse_body(ChatCompletionRequest, raw)
        where: dict[str, Any] = {"messages": [m.as_engine_message() for m in body.messages]}
    else:
        body = parse_body(CompletionRequest, raw)
        where = {"prompt": body.prompt_text()}
    length, length_field = body.max_new_tokens()
    prepared = ctx.preparer.prepare(
        **where,
        max_new_tokens=length,
        overrides=body.decode_overrides(),
        prompt_field="messages" if chat else "prompt",
        length_field=length_field,
    )
    return body, prepared


class _Head:
    """Id, timestamps and model shared by a response's objects."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        """The non-streaming answer."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish(result)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(result),
        }

    def chunk(self, delta: Any, finish_reason: str | None = None) -> dict[str, Any]:
        """A streaming chunk: `delta` is a chat delta dict or completion text."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


def _finish(result: GenerateResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _usage(result: GenerateResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
