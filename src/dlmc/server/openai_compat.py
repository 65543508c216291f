"""OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`.

Non-streaming answers are `chat.completion` / `text_completion` objects with `usage`.
Streaming (`"stream": true`) sends server-sent events `data: <chunk json>` — for chat a first
chunk with `delta.role`, then one chunk per finished block, then a chunk with
`finish_reason` and `usage` (and, with `stream_options.include_usage`, a chunk with empty
`choices` and `usage`, as OpenAI sends it) — and ends with `data: [DONE]`. An error after the
stream started is sent as `data: {"error": {...}}` before `[DONE]`. A list of prompts on
/v1/completions is answered prompt after prompt (one choice each, `index` its place in the
list; streamed, each choice's chunks in turn), each waiting its turn in the queue; `n` > 1
gives n choices per prompt the same way (prompt p's choice i is index p * n + i).

`stop` (a string or a list) ends the answer before the first stop sequence that appears;
`stop_reason` names it (as vLLM does). `max_tokens` is a hard cap, as OpenAI's is:
DiffusionGemma's answers grow by whole canvases and may pass the limit (as in transformers'
`generate`), so these endpoints cut the answer at the limit (`finish_reason` "length"; `usage`
counts the tokens sent). LLaDA2's answers never pass it.
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
from dlmc.server.engine_worker import EngineWorker, Job, Prepared, RequestCancelled
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
        card = {"id": ctx.model_name, "object": "model", "created": ctx.created,
                "max_model_len": ctx.llm.max_context}
        return {"object": "list", "data": [{**card, "owned_by": "dlmc"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completion (messages rendered with the checkpoint's chat template)."""
        return await _complete(ctx, request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """OpenAI text completion of a raw prompt, or of a list of them (no chat template)."""
        return await _complete(ctx, request, chat=False)


async def _complete(ctx: ServerContext, request: Request, chat: bool) -> Response:
    try:
        raw = await read_body(request, ctx.max_body_bytes)
        body, prepared = await off_loop(_prepare, ctx, raw, chat)
        jobs = _Jobs(ctx.worker, prepared)
        first = jobs.next()  # a full queue is a 503 before anything is sent
        head = _Head(ctx.model_name, chat)
        caps = [_Cap(ctx.llm.decode_text, p.settings["max_new_tokens"]) for p in prepared]
        if not body.stream:
            results = [(await run_to_end(ctx.worker, first, request)).result]
            for _ in prepared[1:]:
                results.append((await run_to_end(ctx.worker, jobs.next(), request)).result)
            return JSONResponse(head.whole(results, caps))
    except Exception as exc:
        return error_response(exc)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        try:
            if chat:
                yield sse(head.chunk({"role": "assistant", "content": ""}))
            usage: list[dict[str, int]] = []
            for index, cap in enumerate(caps):
                job = first if index == 0 else jobs.next()
                async for event in ctx.worker.events(job):
                    if isinstance(event, BlockChunk):
                        text = cap.add(event.token_ids, event.text)
                        if text:
                            yield sse(head.chunk({"content": text} if chat else text, index))
                        continue
                    result = event.result
                    usage.append(cap.usage(result))
                    last = head.chunk({} if chat else "", index, cap.finish(result),
                                      cap.stop_reason(result))
                    yield sse({**last, "usage": usage[-1]})
            if include_usage:
                yield sse({**head.chunk(None), "choices": [], "usage": _total(usage)})
        except Exception as exc:
            yield sse(api_error(exc).body())
        yield sse("[DONE]")

    return EventStream(chunks(), on_close=jobs.cancel)


def _prepare(
    ctx: ServerContext, raw: bytes, chat: bool
) -> tuple[ChatCompletionRequest | CompletionRequest, list[Prepared]]:
    """Parse and check a /v1 body and encode its prompts (on the handlers' pool)."""
    body: ChatCompletionRequest | CompletionRequest
    if chat:
        body = parse_body(ChatCompletionRequest, raw)
        prompts: list[tuple[dict[str, Any], str]] = [
            ({"messages": [m.as_engine_message() for m in body.messages]}, "messages")]
    else:
        body = parse_body(CompletionRequest, raw)
        prompts = [({"prompt": text}, field) for text, field in body.prompt_texts()]
    length, length_field = body.max_new_tokens()
    prepared = [
        ctx.preparer.prepare(
            **where,
            max_new_tokens=length,
            overrides=body.decode_overrides(),
            stop=body.stop,
            prompt_field=field,
            length_field=length_field,
        )
        for where, field in prompts
    ]
    return body, [_choice(p, i, body.n) for p in prepared for i in range(body.n)]


def _choice(prepared: Prepared, i: int, n: int) -> Prepared:
    """Choice `i` of `n` for a prompt: with a seed, its own (seed + i)."""
    seed = prepared.settings.get("seed")
    if n == 1 or seed is None:
        return prepared
    return Prepared(prepared.prompt_token_ids, {**prepared.settings, "seed": (seed + i) % 2**63})


class _Jobs:
    """A request's prompts, submitted one after another: each waits its turn in the queue
    as a request of its own would, and only the first can find the queue full. `cancel`
    stops the one decoding and submits no more."""

    def __init__(self, worker: EngineWorker, prepared: list[Prepared]) -> None:
        self.worker, self.waiting = worker, list(prepared)
        self.current: Job | None = None
        self.cancelled = False

    def next(self) -> Job:
        if self.cancelled:
            raise RequestCancelled("the request was cancelled")
        # Only the first part can be refused: an admitted request is answered whole.
        self.current = self.worker.submit(self.waiting.pop(0), admitted=self.current is not None)
        return self.current

    def cancel(self) -> None:
        self.cancelled = True
        if self.current is not None:
            self.current.cancel()


def _total(usages: list[dict[str, int]]) -> dict[str, int]:
    return {key: sum(u[key] for u in usages) for key in usages[0]} if usages else {}


class _Head:
    """Id, timestamps and model shared by a response's objects."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, results: list[GenerateResult], caps: list[_Cap]) -> dict[str, Any]:
        """The non-streaming answer, one choice per prompt, each cut at the token limit."""
        choices = []
        for index, (result, cap) in enumerate(zip(results, caps, strict=True)):
            choice: dict[str, Any] = {"index": index, "logprobs": None,
                                      "finish_reason": cap.finish(result),
                                      "stop_reason": cap.stop_reason(result)}
            text = cap.text_of(result)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _total([cap.usage(r) for r, cap in zip(results, caps, strict=True)]),
        }

    def chunk(self, delta: Any, index: int = 0, finish_reason: str | None = None,
              stop_reason: str | None = None) -> dict[str, Any]:
        """A streaming chunk of choice `index`: `delta` is a chat delta dict or completion
        text."""
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": finish_reason, "stop_reason": stop_reason}
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

    def stop_reason(self, result: GenerateResult) -> str | None:
        """The stop sequence that ended the answer (vLLM's field), unless the cap cut it."""
        return result.stop_reason if self.finish(result) == "stop" else None

    def usage(self, result: GenerateResult) -> dict[str, int]:
        prompt, completion = len(result.prompt_token_ids), min(len(result.token_ids), self.limit)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
