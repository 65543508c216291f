"""`POST /tokenize` and `POST /detokenize` (as vLLM serves them): the model's tokenizer, so
that a client can count a prompt's tokens against the context before it sends a request."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dlmc.engine.request_checks import checked_token_ids
from dlmc.errors import DlmcError
from dlmc.server.context import ServerContext
from dlmc.server.handling import error_response, off_loop, read_body
from dlmc.server.schemas import ApiError, DetokenizeRequest, TokenizeRequest, parse_body


def add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Register /tokenize and /detokenize on `app`."""

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        """`{"prompt": "..."}` or `{"messages": [...]}` -> `{"tokens": [...], "count": n,
        "max_model_len": the server's context}`: the ids a request with that prompt
        decodes from (the chat template applied to messages)."""
        try:
            raw = await read_body(request, ctx.max_body_bytes)
            return JSONResponse(await off_loop(_tokenize, ctx, raw))
        except Exception as exc:
            return error_response(exc)

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> Response:
        """`{"tokens": [...]}` -> `{"prompt": text}`, special tokens included."""
        try:
            raw = await read_body(request, ctx.max_body_bytes)
            return JSONResponse(await off_loop(_detokenize, ctx, raw))
        except Exception as exc:
            return error_response(exc)


def _tokenize(ctx: ServerContext, raw: bytes) -> dict[str, Any]:
    body = parse_body(TokenizeRequest, raw)
    ids = ctx.preparer.encode(*body.engine_prompt())
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.llm.max_context}


def _detokenize(ctx: ServerContext, raw: bytes) -> dict[str, Any]:
    body = parse_body(DetokenizeRequest, raw)
    try:
        ids = checked_token_ids(body.tokens, "tokens", ctx.llm.config.vocab_size)
        return {"prompt": ctx.llm.tokenizer.decode(ids)}
    except DlmcError as exc:
        raise ApiError(400, str(exc), param="tokens") from None
