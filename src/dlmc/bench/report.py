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
    """One row per benchmark: problems, correct, accuracy %, TPF, tokens/s, prompt and extractor."""
    table = Table(title="dlmc bench suite", title_justify="left")
    for column in ("benchmark", "subset", "problems", "correct", "accuracy %", "TPF",
                   "tokens/s", "shots", "prompt", "extracted by"):
        numeric = column in ("problems", "correct", "accuracy %", "TPF", "tokens/s", "shots")
        table.add_column(column, justify="right" if numeric else "left")
    for s in summaries:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(s.extractor_counts.items()))
        table.add_row(
            s.name, s.subset, str(s.problems), str(s.correct), f"{s.accuracy:.1f}",
            f"{s.tokens_per_forward:.2f}", f"{s.tokens_per_s:.1f}", str(s.plan.shots),
            s.plan.style, counts,
        )
    return table


def settings_text(
    run: dict[str, Any], device: str, engine_settings: dict[str, Any] | None
) -> Text:
    """The engine and suite settings under the table."""
    decode = engine_settings or {k: run.get(k) for k in ("threshold", "edit_threshold",
                                                          "block_length", "max_new_tokens")}
    lines = [
        (f"model {run.get('model')}  role {run.get('role')}  "
         f"precision {run.get('precision')}  device {device}"),
        "decode (greedy): " + "  ".join(f"{k}={v}" for k, v in decode.items()),
        (f"max_new_tokens={run.get('max_new_tokens')}  seed={run.get('seed')}  "
         f"code timeout {run.get('code_timeout_s')} s, memory {run.get('code_memory_mb')} MiB"),
    ]
    return Text("\n".join(lines), style="dim")


def render_report(
    summaries: Sequence[BenchmarkSummary], run: dict[str, Any], device: str,
    engine_settings: dict[str, Any] | None,
) -> Group:
    """The table followed by the settings and each benchmark's prompt and checker."""
    details = [
        f"{s.name}: {s.file}; {s.plan.shots}-shot ({s.plan.exemplars}), {s.plan.style}; "
        f"extractor: {s.plan.extractor}; checker: {s.checker} (instruction in summary.json)"
        for s in summaries
    ]
    return Group(summary_table(summaries), settings_text(run, device, engine_settings),
                 Text("\n".join(details), style="dim"))
