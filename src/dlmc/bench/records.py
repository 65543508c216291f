"""Per-problem records and per-benchmark summaries, as written to ``--out``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from dlmc.bench.prompts import PromptPlan
from dlmc.errors import ConfigError


@dataclass(frozen=True)
class ProblemRecord:
    """One scored problem: a line of ``<benchmark>.jsonl`` in the output directory."""

    id: str
    prompt: Any
    output: str
    extracted: str | None
    extractor: str
    correct: bool
    reason: str
    forwards: int
    tokens: int
    seconds: float
    finish_reason: str

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(asdict(self), ensure_ascii=False)


@dataclass(frozen=True)
class BenchmarkSummary:
    """The scores of one problem file, with everything a report must state (docs/eval.md)."""

    name: str
    file: str
    subset: str
    problems: int
    correct: int
    forwards: int
    tokens: int
    seconds: float
    plan: PromptPlan
    checker: str
    extractor_counts: dict[str, int] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """Correct / problems, in percent."""
        return 100.0 * self.correct / self.problems if self.problems else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per model forward (TPF)."""
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation time."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready data."""
        data = asdict(self)
        data.update(accuracy=self.accuracy, tokens_per_forward=self.tokens_per_forward,
                    tokens_per_s=self.tokens_per_s)
        return data


def summarize(
    name: str, file: Path | Traversable, subset: str, plan: PromptPlan, checker: str,
    records: Iterable[ProblemRecord],
) -> BenchmarkSummary:
    """Sum ``records`` into a `BenchmarkSummary`."""
    records = list(records)
    return BenchmarkSummary(
        name=name, file=str(file), subset=subset, problems=len(records),
        correct=sum(r.correct for r in records), forwards=sum(r.forwards for r in records),
        tokens=sum(r.tokens for r in records), seconds=sum(r.seconds for r in records),
        plan=plan, checker=checker, extractor_counts=dict(Counter(r.extractor for r in records)),
    )


def read_records(path: Path) -> dict[str, ProblemRecord]:
    """The finished records in a per-problem JSONL file, by id (empty if the file is missing).

    A torn last line (a run killed mid-write) is ignored; any other bad line is an error.
    """
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    records: dict[str, ProblemRecord] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = ProblemRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            if number == len(lines):
                break
            raise ConfigError(f"{path}:{number}: not a dlmc bench record ({exc})") from exc
        records[record.id] = record
    return records


def rewrite_records(path: Path, records: Iterable[ProblemRecord]) -> None:
    """Write ``records`` to ``path`` (drops a torn last line before appending to it)."""
    path.write_text("".join(r.to_json() + "\n" for r in records), encoding="utf-8")
