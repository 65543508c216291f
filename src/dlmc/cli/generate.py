"""`dlmc generate`: decode one prompt with a live view of the block (DiffusionGemma: the
canvas) being denoised."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dlmc.cli.options import (
    decode_kwargs,
    decode_options,
    engine_kwargs,
    kernel_options,
    model_options,
    user_errors,
)


@click.command()
@click.argument("prompt", required=False)
@model_options
@decode_options
@kernel_options
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--raw", is_flag=True, help="Use the prompt as is (no chat template).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("--no-live", is_flag=True, help="No live view; print the text when done.")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="A stop sequence (repeatable): the answer ends before the first that appears.")
@user_errors
def generate(
    prompt: str | None,
    model: str,
    role: str,
    precision: str,
    device: str | None,
    dtype: str | None,
    system: str | None,
    raw: bool,
    as_json: bool,
    no_live: bool,
    stop: tuple[str, ...],
    **decode: Any,
) -> None:
    """Generate an answer to PROMPT (read from stdin if omitted or `-`)."""
    from rich.console import Console

    if prompt in (None, "-"):
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("give a PROMPT argument or pipe one on stdin")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("PROMPT is empty")
    if raw and system:
        raise click.UsageError("--system needs the chat template: drop --raw")
    err = Console(stderr=True)
    llm = load_engine(err, model, role, precision, device, dtype, decode)
    llm.tokenizer  # noqa: B018 - a checkpoint without one stops here, before any output
    request: dict[str, Any] = (
        {"prompt": prompt}
        if raw
        else {
            "messages": ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": prompt}]
        }
    )
    kwargs = decode_kwargs(decode) | ({"stop": list(stop)} if stop else {})
    print_first_rounds_notice(err, llm)
    out = Console()
    live = out.is_terminal and not no_live and not as_json
    result = run_live(llm, request, kwargs, out) if live else llm.generate(**request, **kwargs)
    from dlmc.cli.live import stats_line

    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    elif live:
        out.print(stats_line(result), style="bold")
    else:
        click.echo(result.text)
        click.echo(stats_line(result), err=True)


def load_engine(console: Any, model: str, role: str, precision: str, device: str | None,
                dtype: str | None, params: dict[str, Any]) -> Any:
    """The `LLM` of a command's model options (`params`: its other parameters), loaded under
    a spinner on `console` (generate, chat and serve)."""
    with console.status(f"loading {model}…", spinner="dots"):
        from dlmc.api import LLM

        return LLM(model, role=role, precision=precision, device=device, dtype=dtype,
                   show_progress=True, **engine_kwargs(params))


def first_rounds_notice(mode: str, device_type: str) -> str | None:
    """What the first rounds of `mode` spend time on, or None where they run as they are (eager
    and reference rounds)."""
    if mode == "graph":
        return ("first rounds compile (Inductor) and capture CUDA graphs: about a minute for a "
                "full-size model on a first start; compiled kernels are cached for the next "
                "one")
    if mode == "compile":
        target = "CUDA kernels" if device_type == "cuda" else "C++ kernels for the CPU"
        return (f"first rounds compile (Inductor, {target}; no graph capture): up to a few "
                "minutes on a first start; compiled kernels are cached for the next one")
    return None


def print_first_rounds_notice(console: Any, llm: Any) -> None:
    """`first_rounds_notice` of `llm`'s mode and device, dimmed on `console`."""
    notice = first_rounds_notice(llm.mode, llm.device.type)
    if notice:
        console.print(f"[dim]{notice}[/dim]")


def run_live(llm: Any, request: dict[str, Any], kwargs: dict[str, Any], console: Any) -> Any:
    """Decode `request` with a live view of each block (canvas) on `console`; the result."""
    from rich.live import Live

    from dlmc.cli.live import render_block, render_canvas
    from dlmc.results import BlockChunk, CanvasRoundEvent, Done, RoundEvent

    text, result = "", None
    piece_cache: dict[int, str] = {}

    def token_text(tok: int) -> str:
        if tok not in piece_cache:
            piece_cache[tok] = llm.decode_text([tok])
        return piece_cache[tok]

    with Live(
        render_block("", None, token_text), console=console, refresh_per_second=20, transient=False
    ) as view:
        for event in llm.stream(**request, **kwargs, rounds=True):
            if isinstance(event, RoundEvent):
                view.update(render_block(text, event, token_text))
            elif isinstance(event, CanvasRoundEvent):
                view.update(render_canvas(text, event, token_text))
            elif isinstance(event, BlockChunk):
                text += event.text
                view.update(render_block(text, None, token_text))
            elif isinstance(event, Done):
                result = event.result
                view.update(render_block(result.text, None, token_text))
    return result
