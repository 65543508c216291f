"""The benchmark runner behind ``dlmc bench suite``: generate, score, record, resume."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from dlmc.bench.problems import ProblemSet
from dlmc.bench.prompts import Prompt, PromptPlan, PromptStyle, build_prompt, cut_at_stop
from dlmc.bench.records import (
    BenchmarkSummary,
    ProblemRecord,
    read_records,
    rewrite_records,
    summarize,
)
from dlmc.bench.scorers import ScoreResult, score_gsm8k, score_humaneval, score_math, score_mbpp
from dlmc.bench.scorers.math_verify_pool import MathVerifier
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_settings import CANVAS_KEYS


class GenerateFn(Protocol):
    """The part of `dlmc.LLM` the runner uses."""

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class SuiteSettings:
    """Decode and scoring settings of a suite run (``None``: the engine's default)."""

    max_new_tokens: int = 4096
    threshold: float | None = None
    edit_threshold: float | None = None
    block_length: int | None = None
    max_refine_steps: int | None = None
    # DiffusionGemma's sampler (CANVAS_KEYS)
    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    seed: int | None = 0
    prompt_style: PromptStyle = "chat"
    few_shot: bool = False
    code_timeout_s: float = 3.0
    code_memory_mb: int = 2048
    math_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("threshold", "edit_threshold"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.prompt_style not in ("chat", "raw"):
            raise ConfigError(f"prompt_style must be 'chat' or 'raw', got {self.prompt_style!r}")
        if self.code_timeout_s <= 0 or self.code_memory_mb <= 0 or self.math_timeout_s <= 0:
            raise ConfigError("code_timeout_s, code_memory_mb and math_timeout_s must be positive")

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LLM.generate`` (unset options are left to the engine)."""
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0,
                                  "seed": self.seed}
        for name in ("threshold", "edit_threshold", "block_length", "max_refine_steps",
                     *CANVAS_KEYS):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


def checker_name(benchmark: str, settings: SuiteSettings) -> str:
    """The equivalence checker or executor of a benchmark, with its version and limits."""
    if benchmark == "math500":
        version = _version("math-verify")
        return f"math-verify {version} (worker processes, timeout {settings.math_timeout_s:g} s)"
    if benchmark in ("humaneval", "mbpp"):
        return (f"python -I subprocess, exit 0 = pass, timeout {settings.code_timeout_s:g} s, "
                f"RLIMIT_AS {settings.code_memory_mb} MiB, no network")
    return "numeric |pred - gold| < 1e-6"


def score_output(
    benchmark: str, text: str, row: dict[str, Any], prompt: Prompt, settings: SuiteSettings,
    verifier: MathVerifier | None,
) -> ScoreResult:
    """Score one (already stop-cut) output with the benchmark's scorer."""
    if benchmark == "gsm8k":
        return score_gsm8k(text, row)
    if benchmark == "math500":
        return score_math(text, row, verifier=verifier)
    limits = {"timeout_s": settings.code_timeout_s, "memory_mb": settings.code_memory_mb}
    if benchmark == "humaneval":
        return score_humaneval(text, row, raw_completion=prompt.raw_completion, **limits)
    return score_mbpp(text, row, **limits)


def run_benchmark(
    llm: GenerateFn,
    problems: ProblemSet,
    plan: PromptPlan,
    shots: Sequence[dict[str, Any]],
    settings: SuiteSettings,
    out_dir: Path,
    *,
    name: str | None = None,
    verifier: MathVerifier | None = None,
    on_record: Callable[[ProblemRecord, bool], None] | None = None,
    on_settings: Callable[[dict[str, Any]], None] | None = None,
) -> BenchmarkSummary:
    """Run one problem set: skip problems already in ``out_dir/<name>.jsonl``, generate and score
    the rest, appending a record per problem as it finishes.

    ``on_record(record, resumed)`` is called for every problem (resumed ones first);
    ``on_settings`` gets the engine's effective decode settings of the first generation.
    """
    name = name or problems.benchmark
    path = out_dir / f"{name}.jsonl"
    done = read_records(path)
    rewrite_records(path, done.values())
    wanted = {p.id for p in problems.problems}
    for record in done.values():
        if record.id in wanted and on_record is not None:
            on_record(record, True)
    with open(path, "a", encoding="utf-8") as out:
        for problem in problems.problems:
            if problem.id in done:
                continue
            prompt = build_prompt(problems.benchmark, problem.row, plan, shots)
            result = _generate(llm, prompt, settings)
            if on_settings is not None and getattr(result, "settings", None):
                on_settings(dict(result.settings))
                on_settings = None
            scored_text = cut_at_stop(result.text, prompt.stop)
            score = score_output(problems.benchmark, scored_text, problem.row, prompt, settings,
                                 verifier)
            record = ProblemRecord(
                id=problem.id, prompt=prompt.as_record(), output=result.text,
                extracted=score.extracted, extractor=score.extractor, correct=score.correct,
                reason=score.reason, forwards=int(result.num_forwards),
                tokens=len(result.token_ids), seconds=float(result.elapsed_s),
                finish_reason=str(result.finish_reason),
            )
            out.write(record.to_json() + "\n")
            out.flush()
            done[record.id] = record
            if on_record is not None:
                on_record(record, False)
    records = [done[p.id] for p in problems.problems]
    return summarize(name, problems.path, problems.subset, plan,
                     checker_name(problems.benchmark, settings), records)


def _generate(llm: GenerateFn, prompt: Prompt, settings: SuiteSettings) -> Any:
    kwargs = settings.generate_kwargs()
    if prompt.messages is not None:
        return llm.generate(messages=[dict(m) for m in prompt.messages], **kwargs)
    return llm.generate(prompt.text, **kwargs)


def check_run_file(out_dir: Path, run_info: dict[str, Any]) -> None:
    """Create ``out_dir/run.json`` or check that a resumed run uses the same settings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "run.json"
    if path.is_file():
        previous = json.loads(path.read_text(encoding="utf-8"))
        for key in sorted(set(previous) | set(run_info)):
            if previous.get(key) != run_info.get(key):
                raise ConfigError(
                    f"{path}: this --out holds a run with {key}={previous.get(key)!r}, not "
                    f"{run_info.get(key)!r}; resume with the same settings or use another --out"
                )
        return
    path.write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")


def run_info(model: str, role: str, precision: str, settings: SuiteSettings,
             revision: str | None = None) -> dict[str, Any]:
    """What must match for a rerun to resume (everything that changes outputs or scores)."""
    data = asdict(settings)
    return {"model": model, "revision": revision, "role": role, "precision": precision, **data}


def write_summary(
    out_dir: Path, run: dict[str, Any], device: str, engine_settings: dict[str, Any] | None,
    summaries: Sequence[BenchmarkSummary],
) -> dict[str, Any]:
    """Write ``out_dir/summary.json`` and return its data; keeps the engine settings of an
    earlier run when this one generated nothing (everything resumed)."""
    path = out_dir / "summary.json"
    if engine_settings is None and path.is_file():
        engine_settings = json.loads(path.read_text(encoding="utf-8")).get("engine_settings")
    data = {
        "run": run, "device": device, "engine_settings": engine_settings,
        "versions": {"dlmc": _version("dlmc"), "math-verify": _version("math-verify"),
                     "torch": _version("torch"), "python": platform.python_version()},
        "benchmarks": [s.to_dict() for s in summaries],
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return data


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"
