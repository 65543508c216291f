"""Problem files (the packaged ones or the user's JSONL): recognise the benchmark, load, subset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from dlmc.errors import ConfigError

# Most specific first: a file is the first benchmark whose required fields its first row has.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "humaneval": ("task_id", "prompt", "entry_point", "test"),
    "mbpp": ("task_id", "text", "code", "test_list"),
    "math500": ("problem", "answer"),
    "gsm8k": ("question", "answer"),
}
ALIASES = {"math": "math500", "math-500": "math500", "human-eval": "humaneval", "gsm": "gsm8k"}
BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp")  # each ships as dlmc/bench/data/NAME.jsonl
DATA_PACKAGE = "dlmc.bench.data"
MBPP_TEST_IDS = range(11, 511)  # google-research MBPP README: 11-510 test, 1-10 few-shot pool


@dataclass(frozen=True)
class Problem:
    """One problem: a stable id (used for resuming) and its row as read from the file."""

    id: str
    row: dict[str, Any]


@dataclass(frozen=True)
class ProblemSet:
    """The problems of one file that a run scores.

    Attributes:
        benchmark: ``gsm8k``, ``math500``, ``humaneval`` or ``mbpp``.
        path: the JSONL file (a packaged one is a `Traversable` of ``dlmc.bench.data``).
        subset: a description of the rows used (e.g. ``"MBPP test split, task_id 11-510"``).
        problems: the problems, in file order, after the subset and ``limit``.
        all_rows: every row of the file (MBPP draws its few-shot exemplars from task_ids 2-4).
    """

    benchmark: str
    path: Path | Traversable
    subset: str
    problems: tuple[Problem, ...]
    all_rows: tuple[dict[str, Any], ...] = field(repr=False)


def parse_problem_spec(spec: str) -> tuple[str | None, Path]:
    """Split ``name=path`` into ``(name, path)``; a bare path gives ``(None, path)``."""
    name, sep, rest = spec.partition("=")
    if sep and canonical_name(name) is not None:
        return canonical_name(name), Path(rest)
    return None, Path(spec)


def canonical_name(name: str) -> str | None:
    """The benchmark a name (or alias) refers to, or ``None``."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in REQUIRED_FIELDS else None


def detect_benchmark(row: dict[str, Any], path: Path | Traversable) -> str:
    """The benchmark whose fields ``row`` has; a `ConfigError` naming the file otherwise."""
    for name, fields in REQUIRED_FIELDS.items():
        if all(f in row for f in fields):
            return name
    expected = "; ".join(f"{name}: {', '.join(fields)}" for name, fields in REQUIRED_FIELDS.items())
    raise ConfigError(
        f"{path}: cannot tell which benchmark this file is; its first row has fields "
        f"{sorted(row)}. Expected the fields of one of ({expected}), or name it as "
        f"'gsm8k={path}' (names: {', '.join(BENCHMARKS)})."
    )


def packaged_file(name: str) -> Traversable:
    """The problem file shipped with dlmc for a benchmark name or alias (see data/SOURCES.md)."""
    benchmark = canonical_name(name)
    if benchmark is None:
        names = ", ".join(BENCHMARKS)
        raise ConfigError(f"{name!r} is not a packaged problem set (names: {names})")
    return resources.files(DATA_PACKAGE).joinpath(f"{benchmark}.jsonl")


def resolve_problem_spec(spec: str) -> tuple[str | None, Path | Traversable]:
    """The benchmark (``None``: recognise it from the fields) and file of a ``--problems`` value.

    A bare name (``gsm8k``, ``math500``, ``humaneval``, ``mbpp`` or an alias) is the packaged file;
    anything else is ``FILE`` or ``NAME=FILE`` (write ``./gsm8k`` for a local file of that name).
    """
    if "=" not in spec and canonical_name(spec) is not None:
        return canonical_name(spec), packaged_file(spec)
    name, path = parse_problem_spec(spec)
    if not path.is_file():
        raise ConfigError(
            f"--problems {spec}: no such file {str(path)!r}; give a JSONL file, NAME=FILE, or one "
            f"of the packaged problem sets {', '.join(BENCHMARKS)}"
        )
    return name, path


def read_jsonl(path: Path | Traversable) -> list[dict[str, Any]]:
    """The rows of a JSONL file; errors name the file and line."""
    if not path.is_file():
        raise ConfigError(f"{path}: problem file not found")
    rows: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object per line")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: the file has no rows")
    return rows


def load_problem_set(spec: str, *, limit: int | None = None) -> ProblemSet:
    """Load a problem set given as a packaged name, ``path`` or ``name=path``.

    The benchmark is recognised from the first row's fields unless named. Every row must have the
    benchmark's fields. MBPP uses its test split (task_id 11-510) when the file has those rows;
    the others use every row. ``limit`` keeps the first N problems of the subset.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    name, path = resolve_problem_spec(spec)
    rows = read_jsonl(path)
    benchmark = name or detect_benchmark(rows[0], path)
    for number, row in enumerate(rows, start=1):
        missing = [f for f in REQUIRED_FIELDS[benchmark] if f not in row]
        if missing:
            raise ConfigError(f"{path}: row {number} lacks field(s) {missing} of {benchmark}")
    problems = [Problem(_problem_id(benchmark, row, i), row) for i, row in enumerate(rows)]
    subset = f"all {len(rows)} rows"
    if benchmark == "mbpp":
        test = [p for p in problems if p.row["task_id"] in MBPP_TEST_IDS]
        if test:
            problems, subset = test, f"MBPP full test split, task_id 11-510 ({len(test)} rows)"
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: duplicate problem ids; ids must be unique for resuming")
    if limit is not None and limit < len(problems):
        problems = problems[:limit]
        subset += f", first {limit}"
    return ProblemSet(benchmark, path, subset, tuple(problems), tuple(rows))


def _problem_id(benchmark: str, row: dict[str, Any], index: int) -> str:
    if benchmark in ("humaneval", "mbpp"):
        return str(row["task_id"])
    if benchmark == "math500" and "unique_id" in row:
        return str(row["unique_id"])
    return f"row-{index}"
