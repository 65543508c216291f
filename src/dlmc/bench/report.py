"""The rich table a suite run prints, and the device description it states."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dlmc.bench.records import BenchmarkSummary


def describe_device(llm: Any) -> str:
    """The device the engine runs on, with the GPU's name for CUDA devices."""
    device = getattr(llm, "device", None)
    if device is None:
        return "unknown"
    if getattr(device, "type", None) == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def summary_table(summaries: Sequence[BenchmarkSummary]) -> Table:
    """One row per benchmark: problems, correct, accuracy %, TPF, tokens/s (fits 80 columns)."""
    table = Table(title="dlmc bench suite", title_justify="left")
    table.add_column("benchmark", no_wrap=True)
    for column in ("problems", "correct", "accuracy %", "TPF", "tokens/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for s in summaries:
        table.add_row(
            s.name, str(s.problems), str(s.correct), f"{s.accuracy:.1f}",
            f"{s.tokens_per_forward:.2f}", f"{s.tokens_per_s:.1f}",
        )
    return table


_DECODE_KEYS = ("algorithm", "threshold", "edit_threshold", "max_refine_steps", "steps",
                "block_length", "max_new_tokens", "temperature", "precision", "dtype")


def settings_text(
    run: dict[str, Any], device: str, engine_settings: dict[str, Any] | None
) -> Text:
    """The engine and suite settings under the table."""
    source = engine_settings or run
    decode = {k: source[k] for k in _DECODE_KEYS if k in source}
    lines = [
        (f"model {run.get('model')}  role {run.get('role')}  device {device}  "
         f"seed {run.get('seed')}"),
        "decode: " + "  ".join(f"{k}={v}" for k, v in decode.items()),
        (f"code: timeout {run.get('code_timeout_s')} s, memory {run.get('code_memory_mb')} MiB;  "
         f"math-verify timeout {run.get('math_timeout_s')} s"),
    ]
    return Text("\n".join(lines), style="dim")


def render_report(
    summaries: Sequence[BenchmarkSummary], run: dict[str, Any], device: str,
    engine_settings: dict[str, Any] | None,
) -> Group:
    """The table, then the settings, then each benchmark's subset, prompt, extractor, checker."""
    details = []
    for s in summaries:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(s.extractor_counts.items()))
        details.append(
            f"{s.name}: {s.file} ({s.subset}); {s.plan.shots}-shot ({s.plan.exemplars}), "
            f"{s.plan.style}; extractor: {s.plan.extractor} [{counts}]; checker: {s.checker}"
        )
    details.append("exact instructions: summary.json, benchmarks[].plan.instruction")
    return Group(summary_table(summaries), settings_text(run, device, engine_settings),
                 Text("\n".join(details), style="dim"))
