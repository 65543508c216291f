"""Benchmarks: `dlmc bench suite` and the scorers, importable to score outputs of your own.

    from dlmc.bench import score_math
    result = score_math(response_text, problem_row)   # result.correct, result.extracted

Each ``score_*`` takes ``(response_text, problem_row)`` (a row of the benchmark's JSONL file) and
returns a `ScoreResult`. Generated code and math-verify run in subprocesses, never in this process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ScoreResult", "score_gsm8k", "score_humaneval", "score_math", "score_mbpp"]

if TYPE_CHECKING:
    from dlmc.bench.scorers import (
        ScoreResult,
        score_gsm8k,
        score_humaneval,
        score_math,
        score_mbpp,
    )


def __getattr__(name: str) -> Any:
    # Lazy, so that `dlmc bench --help` does not import the scorers.
    if name in __all__:
        from dlmc.bench import scorers

        return getattr(scorers, name)
    raise AttributeError(f"module 'dlmc.bench' has no attribute {name!r}")
