"""OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`.

Non-streaming answers are `chat.completion` / `text_completion` objects with `usage`.
Streaming (`"stream": true`) sends server-sent events `data: <chunk json>` — for chat a first
chunk with `delta.role`, then one chunk per finished block, then a chunk with
`finish_reason` and `usage` (and, with `stream_options.include_usage`, a chunk with empty
`choices` and `usage`, as OpenAI sends it) — and ends with `data: [DONE]`. An error after the
stream started is sent as `data: {"error": {...}}` before `[DONE]`.

`max_tokens` is a hard cap, as OpenAI's is: DiffusionGemma's answers grow by whole canvases
and may pass the limit (as in transformers' `generate`), so these endpoints cut the answer at
the limit (`finish_reason` "length"; `usage` counts the tokens sent). LLaDA2's answers never
pass it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
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
        cap = _Cap(ctx.llm.decode_text, prepared.settings["max_new_tokens"])
        if not body.stream:
            done = await run_to_end(ctx.worker, job, request)
            return JSONResponse(head.whole(done.result, cap))
    except Exception as exc:
        return error_response(exc)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        try:
            if chat:
                yield sse(head.chunk({"role": "assistant", "content": ""}))
            async for event in ctx.worker.events(job):
                if isinstance(event, BlockChunk):
                    text = cap.add(event.token_ids, event.text)
                    if text:
                        yield sse(head.chunk({"content": text} if chat else text))
                    continue
                result = event.result
                last = head.chunk({} if chat else "", finish_reason=cap.finish(result))
                yield sse({**last, "usage": cap.usage(result)})
                if include_usage:
                    yield sse({**head.chunk(None), "choices": [], "usage": cap.usage(result)})
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

    def whole(self, result: GenerateResult, cap: _Cap) -> dict[str, Any]:
        """The non-streaming answer, cut at the token limit."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": cap.finish(result)}
        text = cap.text_of(result)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": cap.usage(result),
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



class _Cap:
    """An answer held to `limit` tokens: the text of the ids within it, the finish reason and
    the usage of what was sent. `decode(ids)` is the engine's text of answer ids."""

    def __init__(self, decode: Callable[[list[int]], str], limit: int) -> None:
        self.decode, self.limit = decode, limit
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_ids: Sequence[int], text: str) -> str:
        """The text a finished block adds within the limit (its own `text` when it fits)."""
        room = self.limit - len(self.ids)
        if len(token_ids) <= room:
            self.ids.extend(token_ids)
            self.text += text
            return text
        if room <= 0:
            return ""
        self.ids.extend(token_ids[:room])
        cut = self.decode(self.ids).rstrip("\ufffd")  # no half character at the cut
        added, self.text = cut[len(self.text):], cut
        return added

    def text_of(self, result: GenerateResult) -> str:
        if len(result.token_ids) <= self.limit:
            return result.text
        return self.decode(list(result.token_ids[: self.limit])).rstrip("\ufffd")

    def finish(self, result: GenerateResult) -> str:
        cut = len(result.token_ids) > self.limit
        return "length" if cut or result.finish_reason == "length" else "stop"

    def usage(self, result: GenerateResult) -> dict[str, int]:
        prompt, completion = len(result.prompt_token_ids), min(len(result.token_ids), self.limit)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
