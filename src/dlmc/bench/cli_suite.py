"""The body of ``dlmc bench suite``: load files, run each benchmark with a live progress bar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dlmc.bench.problems import (
    BENCHMARKS,
    ProblemSet,
    canonical_name,
    load_problem_set,
    read_jsonl,
)
from dlmc.bench.prompts import PromptPlan, plan_prompts
from dlmc.bench.records import BenchmarkSummary, ProblemRecord
from dlmc.bench.report import describe_device, render_report
from dlmc.bench.scorers.math_verify_pool import MathVerifier
from dlmc.bench.suite import (
    SuiteSettings,
    check_run_file,
    run_benchmark,
    run_info,
    write_summary,
)
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_settings import CANVAS_KEYS


def run_suite(options: dict[str, Any], load_llm: Callable[..., Any]) -> list[BenchmarkSummary]:
    """Run ``dlmc bench suite`` with the parsed CLI ``options``; returns the summaries."""
    settings = SuiteSettings(
        max_new_tokens=options["max_new_tokens"], threshold=options["threshold"],
        edit_threshold=options["edit_threshold"], block_length=options["block_length"],
        max_refine_steps=options["max_refine_steps"], seed=options["seed"],
        **{key: options[key] for key in CANVAS_KEYS},
        prompt_style=options["prompt_style"], few_shot=options["few_shot"],
        code_timeout_s=options["code_timeout"], code_memory_mb=options["code_memory_mb"],
        math_timeout_s=options["math_timeout"],
    )
    specs = list(options["problem_specs"]) + list(options["more_problems"])
    if not specs:
        raise ConfigError(f"--problems: give at least one of {', '.join(BENCHMARKS)} or a file")
    sets = [load_problem_set(spec, limit=options["limit"]) for spec in specs]
    names = [s.benchmark for s in sets]
    if len(set(names)) != len(names):
        raise ConfigError(f"--problems: one file per benchmark, got {names}")
    exemplars = _load_exemplars(options["exemplars"])
    plans: list[tuple[ProblemSet, PromptPlan, tuple[dict[str, Any], ...]]] = []
    for problems in sets:
        rows, source = exemplars.get(problems.benchmark, (None, ""))
        plan, shots = plan_prompts(problems, settings.prompt_style, settings.few_shot, rows, source)
        plans.append((problems, plan, shots))
    out_dir: Path = options["out_dir"]
    run = run_info(options["model"], options["role"], options["precision"], settings,
                   revision=options.get("revision"))
    check_run_file(out_dir, run)

    console = Console()
    llm = load_llm(options["model"], options["role"], options["precision"], options["device"],
                   options.get("kv_cache_dtype") or "auto", options.get("revision"))
    llm.decode_settings(**settings.generate_kwargs())  # what the model refuses fails here
    device = describe_device(llm)
    engine_settings: dict[str, Any] | None = None

    def keep_settings(values: dict[str, Any]) -> None:
        nonlocal engine_settings
        engine_settings = values

    summaries: list[BenchmarkSummary] = []
    columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("acc {task.fields[acc]}"), TimeElapsedColumn())
    with MathVerifier(timeout_s=settings.math_timeout_s) as verifier, \
            Progress(*columns, console=console) as progress:
        for problems, plan, shots in plans:
            task = progress.add_task(problems.benchmark, total=len(problems.problems), acc="-")
            tally = {"done": 0, "correct": 0}

            def on_record(record: ProblemRecord, resumed: bool, task: Any = task,
                          tally: dict[str, int] = tally) -> None:
                tally["done"] += 1
                tally["correct"] += record.correct
                acc = f"{100.0 * tally['correct'] / tally['done']:.1f}%"
                progress.update(task, advance=1, acc=acc)

            summaries.append(run_benchmark(
                llm, problems, plan, shots, settings, out_dir, verifier=verifier,
                on_record=on_record, on_settings=keep_settings,
            ))
    written = write_summary(out_dir, run, device, engine_settings, summaries)
    console.print(render_report(summaries, run, device, written["engine_settings"]))
    console.print(f"[dim]per-problem records and summary.json in {out_dir}[/dim]")
    return summaries


def _load_exemplars(
    specs: tuple[str, ...],
) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """``--exemplars NAME=FILE`` options as ``{benchmark: (rows, file)}``."""
    exemplars: dict[str, tuple[list[dict[str, Any]], str]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        benchmark = canonical_name(name) if sep else None
        if benchmark not in ("gsm8k", "math500"):
            raise ConfigError(f"--exemplars {spec!r}: expected gsm8k=FILE or math500=FILE")
        if not Path(path).is_file():
            raise ConfigError(f"--exemplars {spec}: no such file {path!r}")
        exemplars[benchmark] = (read_jsonl(Path(path)), path)
    return exemplars
