"""`dlmc bench`: benchmark commands (`suite`, `round`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dlmc.cli.bench_round import round_cmd
from dlmc.cli.options import canvas_options, error_line
from dlmc.errors import DlmcError


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: model accuracy and speed. Each subcommand has its own --help."""


bench.add_command(round_cmd)  # compiled-rounds timing, in its own module


@bench.command(
    "suite", short_help="Accuracy + speed on GSM8K, MATH-500, HumanEval, MBPP (papers' scorers)."
)
@click.option("--model", "-m", required=True, help="Model id or local checkpoint directory.")
@click.option("--revision", default=None, metavar="REF",
              help="Branch, tag or commit of a Hub repo --model (default: its main branch).")
@click.option("--role", type=click.Choice(["orl", "llada2.1", "llada2.0"]), default="orl",
              show_default=True, help="Decoder and its default settings (see `dlmc generate`).")
@click.option("--precision", type=click.Choice(["auto", "bf16", "nvfp4"]), default="auto",
              show_default=True,
              help="Routed-expert precision (auto: nvfp4 for NVFP4 checkpoints on GPU).")
@click.option("--device", default=None, help="torch device (default: the engine's choice).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16", "fp8"]), default="auto",
              show_default=True, help="KV cache storage (auto: FP8 if the checkpoint says so).")
@click.option("--threshold", type=float, default=None, help="Commit confidence threshold.")
@click.option("--edit-threshold", type=float, default=None, help="Edit (remask) threshold.")
@click.option("--block-length", type=int, default=None, help="Diffusion block length.")
@click.option("--max-refine-steps", type=int, default=None, help="Refinement steps cap.")
@click.option("--max-new-tokens", type=int, default=4096, show_default=True)
@canvas_options
@click.option("--problems", "-p", "problem_specs", multiple=True, metavar="NAME|FILE|NAME=FILE",
              help="Problem sets (more may follow as arguments): the names gsm8k, math500, "
                   "humaneval, mbpp use the files shipped with dlmc; a JSONL file's benchmark is "
                   "recognised from its fields, or named as gsm8k=FILE (math500=, humaneval=, "
                   "mbpp=).")
@click.argument("more_problems", nargs=-1, metavar="[NAME|FILE|NAME=FILE]...")
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Output directory; rerunning with the same one resumes.")
@click.option("--limit", type=int, default=None, help="Only the first N problems of each file.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--prompt-style", type=click.Choice(["chat", "raw"]), default="chat",
              show_default=True, help="chat template (instruct models) or raw text (base).")
@click.option("--few-shot", is_flag=True, help="The papers' few-shot prompts (docs/eval.md).")
@click.option("--exemplars", multiple=True, metavar="NAME=FILE",
              help="Few-shot exemplars for gsm8k/math500 (JSONL in the problem file's format).")
@click.option("--code-timeout", type=float, default=3.0, show_default=True,
              help="Seconds per HumanEval/MBPP program.")
@click.option("--code-memory-mb", type=int, default=2048, show_default=True,
              help="Address-space cap per program.")
@click.option("--math-timeout", type=float, default=10.0, show_default=True,
              help="Seconds per math-verify check.")
def suite(**options: Any) -> None:
    """Score a model on benchmark problems: per-problem JSONL, summary.json and a table in --out.

    GSM8K (1,319), MATH-500 (500), HumanEval (164) and MBPP (full test split, 500) ship with dlmc:
    name them, or give your own JSONL files in the same formats.

    \b
    dlmc bench suite --model M --threshold 0.85 --edit-threshold 0.5 \\
        --problems gsm8k math500 humaneval mbpp --out runs/m
    dlmc bench suite --model M --problems gsm8k=my_gsm8k.jsonl --out runs/mine
    """
    from dlmc.bench.cli_suite import run_suite

    try:
        run_suite(options, load_llm=_load_llm)
    except DlmcError as exc:
        raise click.ClickException(error_line(exc)) from None


def _load_llm(model: str, role: str, precision: str, device: str | None,
              kv_cache_dtype: str = "auto", revision: str | None = None) -> Any:
    """Load the engine (tests replace this with a fake)."""
    from dlmc.api import LLM

    return LLM(model, role=role, precision=precision, device=device,
               kv_cache_dtype=kv_cache_dtype, revision=revision)

