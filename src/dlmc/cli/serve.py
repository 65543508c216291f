"""`dlmc serve`: load a model once, warm it up, and serve it over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import click

from dlmc.cli.generate import load_engine, print_first_rounds_notice
from dlmc.cli.options import (
    decode_kwargs,
    decode_options,
    kernel_options,
    model_options,
    user_errors,
)


@click.command()
@model_options
@decode_options
@kernel_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=18080, show_default=True)
@click.option(
    "--queue-size",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Requests that may wait while one decodes; more are answered 503.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds a request may take, waiting in the queue included.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=1024 * 1024,
    show_default=True,
    help="Largest request body accepted, in bytes; larger ones are answered 413.",
)
@click.option(
    "--served-model-name",
    default=None,
    metavar="NAME",
    help="The model id that /v1/models, /health and the answers report (default: --model).",
)
@click.option(
    "--api-key",
    envvar="DLMC_API_KEY",
    default=None,
    metavar="KEY",
    help="Refuse requests (401) without the header 'Authorization: Bearer KEY'; /health stays "
    "open. Also read from DLMC_API_KEY.",
)
@click.option(
    "--allowed-origin",
    "allowed_origins",
    multiple=True,
    metavar="ORIGIN",
    help="A browser origin (e.g. http://localhost:3000, or *) whose pages may call the server "
    "(CORS); repeatable. Default: none.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@user_errors
def serve(
    model: str,
    role: str,
    precision: str,
    device: str | None,
    dtype: str | None,
    host: str,
    port: int,
    queue_size: int,
    request_timeout: float,
    max_body_bytes: int,
    served_model_name: str | None,
    api_key: str | None,
    allowed_origins: tuple[str, ...],
    log_level: str,
    **decode: Any,
) -> None:
    """Serve a model: POST /generate (streaming), POST /v1/chat/completions,
    POST /v1/completions, GET /v1/models, POST /tokenize and /detokenize, GET /health,
    GET /metrics (Prometheus) and GET /version.

    The decoding options are the defaults of every request (a request's own fields win)."""
    from rich.console import Console

    from dlmc.server import ServerSettings, create_app

    settings = ServerSettings(  # checked before the model loads
        model_name=served_model_name or model,
        queue_size=queue_size,
        request_timeout_s=request_timeout,
        max_body_bytes=max_body_bytes,
        decode_defaults=decode_kwargs(decode),
        api_key=api_key,
        allowed_origins=allowed_origins,
    )
    err = Console(stderr=True)
    llm = load_engine(err, model, role, precision, device, dtype, decode)
    app = create_app(llm, settings)
    print_first_rounds_notice(err, llm)
    with err.status("warming up…", spinner="dots"):
        warm_up(llm, app.state.dlmc.preparer.defaults)
    key_note = ", API key required" if api_key is not None else ""
    err.print(f"dlmc serving {settings.model_name} on http://{host}:{port}{key_note} "
              "(Ctrl-C to stop)", style="bold")
    run_server(app, host, port, log_level)


def run_server(app: Any, host: str, port: int, log_level: str) -> None:
    """Run uvicorn until Ctrl-C or SIGTERM, which cancel the running and waiting requests at
    once (open streams end with an error event instead of holding the shutdown)."""
    import uvicorn

    worker = app.state.dlmc.worker

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.loop is not None:  # a signal handler must not take the worker's lock
                self.loop.call_soon_threadsafe(worker.cancel_all)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        Server(config).run()


def warm_up(llm: Any, defaults: dict[str, Any]) -> None:
    """One short request with the server's decoding defaults (loads the tokenizer, runs the
    model once) so that the first client does not pay for it."""
    from dlmc.errors import DlmcError

    short = {**defaults, "max_new_tokens": 8}
    try:
        llm.generate(messages=[{"role": "user", "content": "Hi!"}], **short)
    except DlmcError:  # a checkpoint without a tokenizer serves token ids only
        llm.generate(prompt_token_ids=[0], **short)
