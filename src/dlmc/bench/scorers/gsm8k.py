"""GSM8K scorer: last number in the response against the `#### N` gold answer (see docs/eval.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dlmc.bench.scorers.result import ScoreResult
from dlmc.errors import ConfigError

# The lm-eval "flexible-extract" pattern, as docs/eval.md states it.
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_GOLD = re.compile(r"####\s*(.+?)\s*$")
_TOLERANCE = 1e-6


def gsm8k_gold(row: Mapping[str, Any]) -> float:
    """The gold answer of a GSM8K row: the text after ``#### `` with commas removed, as a number.

    Raises:
        ConfigError: the row has no ``answer`` field or no ``#### N`` line.
    """
    answer = row.get("answer")
    if not isinstance(answer, str):
        raise ConfigError("GSM8K row: field 'answer' is missing or not a string")
    match = _GOLD.search(answer.strip().splitlines()[-1] if answer.strip() else "")
    if match is None:
        raise ConfigError(f"GSM8K row: field 'answer' has no '#### N' last line: {answer[-80:]!r}")
    text = match.group(1).replace(",", "").replace("$", "")
    try:
        return float(text)
    except ValueError as exc:
        raise ConfigError(f"GSM8K row: '#### {match.group(1)}' is not a number") from exc


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` with ``,``, ``$`` and a trailing ``.`` stripped, or ``None``."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    number = matches[-1].replace(",", "").replace("$", "").rstrip(".")
    return number or None


def score_gsm8k(response_text: str, problem_row: Mapping[str, Any]) -> ScoreResult:
    """Score a GSM8K response: the last number, compared numerically (``|pred - gold| < 1e-6``).

    Cut a few-shot output at the next ``Question:`` before calling this (the suite does).
    """
    gold = gsm8k_gold(problem_row)
    extracted = extract_last_number(response_text)
    if extracted is None:
        return ScoreResult(False, None, "none", "no number in the response")
    try:
        value = float(extracted)
    except ValueError:
        return ScoreResult(False, extracted, "last_number", f"{extracted!r} is not a number")
    if abs(value - gold) < _TOLERANCE:
        return ScoreResult(True, extracted, "last_number")
    return ScoreResult(False, extracted, "last_number", f"{extracted} != gold {gold:g}")
