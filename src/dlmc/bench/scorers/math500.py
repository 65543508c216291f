"""MATH-500 scorer: last ``\\boxed{}`` (fallback: "final answer is"), equivalence by math-verify."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dlmc.bench.scorers.math_verify_pool import MathVerifier, default_verifier
from dlmc.bench.scorers.result import ScoreResult
from dlmc.errors import ConfigError

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FINAL_ANSWER = re.compile(r"final answer is[:\s]*(.+?)(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_final_answer_sentence(text: str) -> str | None:
    """What follows the last "final answer is" up to the end of its sentence, ``$`` stripped."""
    matches = _FINAL_ANSWER.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip().strip("$").strip()
    return answer or None


def extract_math_answer(text: str) -> tuple[str | None, str]:
    """The final answer of a MATH response and the extractor used (``boxed``,
    ``final_answer_sentence`` or ``none``)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    sentence = extract_final_answer_sentence(text)
    if sentence is not None:
        return sentence, "final_answer_sentence"
    return None, "none"


def score_math(
    response_text: str,
    problem_row: Mapping[str, Any],
    *,
    verifier: MathVerifier | None = None,
) -> ScoreResult:
    """Score a MATH-500 response against the row's ``answer`` with math-verify.

    The extracted answer is checked as ``\\boxed{answer}`` in a worker process (a hung check
    scores wrong with the reason). ``verifier`` defaults to a shared one-worker pool.
    """
    gold = problem_row.get("answer")
    if not isinstance(gold, str):
        raise ConfigError("MATH row: field 'answer' is missing or not a string")
    extracted, extractor = extract_math_answer(response_text)
    if extracted is None:
        return ScoreResult(False, None, extractor, "no \\boxed{} and no 'final answer is'")
    result = (verifier or default_verifier()).verify(gold, "\\boxed{" + extracted + "}")
    reason = "" if result.equivalent else (result.reason or f"{extracted!r} != gold {gold!r}")
    return ScoreResult(result.equivalent, extracted, extractor, reason)
