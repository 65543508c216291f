"""`dlmc` command line: `generate`, `chat`, `bench`, `serve`."""

from __future__ import annotations

import click

from dlmc import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmc")
def main() -> None:
    """dlmc: an inference engine for diffusion language models."""


def _register() -> None:
    """Subcommands live in their own modules (generate.py, chat.py, bench.py, serve.py)."""
    from dlmc.cli.bench import bench
    from dlmc.cli.chat import chat
    from dlmc.cli.generate import generate
    from dlmc.cli.serve import serve

    main.add_command(generate)
    main.add_command(chat)
    main.add_command(bench)
    main.add_command(serve)


_register()
