"""`dlmc chat`: a conversation in the terminal with a model loaded once. Each answer streams in
the live view of `dlmc generate`; the turns so far go to the chat template with every new
message."""

from __future__ import annotations

from typing import Any

import click

from dlmc.cli.options import (
    decode_kwargs,
    decode_options,
    error_line,
    kernel_options,
    model_options,
    user_errors,
)

COMMANDS = {
    "/reset": "forget the conversation (the system message stays)",
    "/exit": "leave (also /quit, Ctrl-D, or Ctrl-C at the prompt)",
    "/help": "this list",
}


@click.command()
@model_options
@decode_options
@kernel_options
@click.option("--system", default=None, help="System message at the start of the conversation.")
@click.option("--no-live", is_flag=True, help="No live view; print each answer when done.")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="A stop sequence (repeatable): an answer ends before the first that appears.")
@user_errors
def chat(
    model: str,
    role: str,
    precision: str,
    device: str | None,
    dtype: str | None,
    system: str | None,
    no_live: bool,
    stop: tuple[str, ...],
    **decode: Any,
) -> None:
    """Chat with a model: type a message, read the answer as it is denoised; /reset forgets the
    conversation, /exit (or Ctrl-D) leaves. Ctrl-C during an answer drops that answer."""
    from rich.console import Console
    from rich.markup import escape

    from dlmc.cli.generate import load_engine, print_first_rounds_notice

    err = Console(stderr=True)
    llm = load_engine(err, model, role, precision, device, dtype, decode)
    llm.tokenizer  # noqa: B018 - a checkpoint without a chat template stops here
    kwargs = decode_kwargs(decode) | ({"stop": list(stop)} if stop else {})
    print_first_rounds_notice(err, llm)
    out = Console()
    err.print(f"[dim]chatting with {escape(model)}: /help lists the commands[/dim]")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while (line := _read(out)) is not None:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                messages = list(start)
                err.print("[dim]conversation cleared[/dim]")
            else:
                if text != "/help":
                    err.print(f"unknown command {text}", markup=False, highlight=False)
                for name, what in COMMANDS.items():
                    err.print(f"[dim]{name}: {what}[/dim]")
            continue
        turn = [*messages, {"role": "user", "content": text}]
        result = _answer(llm, turn, kwargs, out, err, live=out.is_terminal and not no_live)
        if result is not None:
            messages = [*turn, {"role": "assistant", "content": result.text}]


def _read(out: Any) -> str | None:
    """The user's next line, or None at the end of input (Ctrl-D, Ctrl-C at the prompt)."""
    try:
        return out.input("[bold cyan]you>[/bold cyan] ")
    except (EOFError, KeyboardInterrupt):
        out.print()
        return None


def _answer(llm: Any, turn: list[dict[str, str]], kwargs: dict[str, Any], out: Any, err: Any,
            live: bool) -> Any:
    """Decode the answer to `turn` (live on a terminal) and print it with its stats line; None
    when it was interrupted or refused (the conversation then goes on without it)."""
    from rich.markup import escape

    from dlmc.cli.generate import run_live
    from dlmc.cli.live import stats_line
    from dlmc.errors import DlmcError

    try:
        result = (run_live(llm, {"messages": turn}, kwargs, out) if live
                  else llm.generate(messages=turn, **kwargs))
    except KeyboardInterrupt:
        err.print("[yellow]answer interrupted; it is left out of the conversation[/yellow]")
        return None
    except DlmcError as exc:  # e.g. a conversation that no longer fits the context
        err.print(f"[red]{escape(error_line(exc))}[/red] (/reset starts over)", highlight=False)
        return None
    if not live:
        out.print(result.text, markup=False, highlight=False)
    err.print(f"[dim]{escape(stats_line(result))}[/dim]", highlight=False)
    return result
