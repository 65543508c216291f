"""MATH-500 scorer: \\boxed{} extraction, math-verify equivalence in worker processes, timeouts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import pytest

from dlmc.bench import score_math
from dlmc.bench.scorers.math500 import (
    extract_boxed,
    extract_final_answer_sentence,
    extract_math_answer,
)
from dlmc.bench.scorers.math_verify_pool import MathVerifier


@pytest.fixture(scope="module")
def verifier() -> Iterator[MathVerifier]:
    with MathVerifier(workers=2) as pool:
        yield pool


def _equivalent_forms(gold: str) -> list[str]:
    """Other ways of writing ``gold`` (those that apply to it)."""
    forms: list[str] = []
    if re.fullmatch(r"-?\d+", gold):
        forms += [f"{gold}.0", f"{gold}.000"]
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{?(\d+)\}?\{?(\d+)\}?", gold)
    if frac:
        sign, num, den = frac.groups()
        forms.append(f"{sign}{num}/{den}")
        value = Fraction(int(num), int(den))
        if 10**6 % value.denominator == 0:
            forms.append(f"{sign}{float(value)}")
    if "\\dfrac" in gold:
        forms.append(gold.replace("\\dfrac", "\\frac"))
    elif "\\frac" in gold:
        forms.append(gold.replace("\\frac", "\\dfrac"))
    if gold.endswith("^\\circ"):
        forms.append(gold.removesuffix("^\\circ"))
    return forms


def test_boxed_extraction_is_last_and_balanced() -> None:
    text = "First \\boxed{1}, then \\boxed{\\frac{1}{\\sqrt{2}}} and more."
    assert extract_boxed(text) == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed{unclosed {") is None
    assert extract_math_answer("So the final answer is $\\frac{3}{4}$. I hope it is correct.") == (
        "\\frac{3}{4}", "final_answer_sentence")
    assert extract_math_answer("nothing here") == (None, "none")
    assert extract_final_answer_sentence(
        "The final answer is 3. No, the final answer is $4$.\nThe final answer is 5 ") == "5"


def test_the_last_final_answer_sentence_counts(
    math_rows: list[dict[str, Any]], verifier: MathVerifier
) -> None:
    # A response that revises its answer is scored on the last "final answer is", not the first.
    def response(first: str, last: str) -> str:
        return (f"So the final answer is ${first}$. Wait, I dropped a term.\n"
                f"Redoing it, the final answer is ${last}$. I hope it is correct.")

    for row in math_rows[::25]:
        gold, wrong = row["answer"], row["answer"] + "+1"
        result = score_math(response(wrong, gold), row, verifier=verifier)
        assert (result.correct, result.extracted) == (True, gold), (gold, result)
        result = score_math(response(gold, wrong), row, verifier=verifier)
        assert (result.correct, result.extracted) == (False, wrong), (gold, result)


def test_every_gold_verifies_against_itself(
    math_rows: list[dict[str, Any]], verifier: MathVerifier
) -> None:
    boxed = verifier.verify_many([(r["answer"], "\\boxed{" + r["answer"] + "}") for r in math_rows])
    assert [r["unique_id"] for r, v in zip(math_rows, boxed, strict=True) if not v.equivalent] == []
    # The fallback extractor (no \boxed{}) through the public scorer, on a sample.
    for row in math_rows[:25]:
        text = f"Thus the final answer is ${row['answer']}$. I hope it is correct."
        result = score_math(text, row, verifier=verifier)
        assert result.correct, (row["answer"], result)
        assert result.extractor == "final_answer_sentence"


def test_every_gold_verifies_against_equivalent_forms(
    math_rows: list[dict[str, Any]], verifier: MathVerifier
) -> None:
    pairs = [(r["answer"], form) for r in math_rows for form in _equivalent_forms(r["answer"])]
    assert len(pairs) > 300  # most golds have at least one other form
    results = verifier.verify_many([(gold, "\\boxed{" + form + "}") for gold, form in pairs])
    assert [p for p, v in zip(pairs, results, strict=True) if not v.equivalent] == []


@pytest.mark.parametrize(("gold", "response"), [
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("0.5", "so it is \\boxed{\\frac{1}{2}}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}"),
    ("3\\sqrt{13}", "\\boxed{\\sqrt{117}}"),
    ("6 - 5i", "\\boxed{-5i + 6}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("x=5", "\\boxed{5}"),
])
def test_equivalent_answers_score_correct(
    gold: str, response: str, verifier: MathVerifier
) -> None:
    assert score_math(response, {"answer": gold}, verifier=verifier).correct


def test_wrong_answers_are_scored_wrong(
    math_rows: list[dict[str, Any]], verifier: MathVerifier
) -> None:
    plus_one = verifier.verify_many(
        [(r["answer"], "\\boxed{" + r["answer"] + "+1}") for r in math_rows])
    assert [r["answer"] for r, v in zip(math_rows, plus_one, strict=True) if v.equivalent] == []
    result = score_math("\\boxed{3}", {"answer": "\\frac{1}{2}"}, verifier=verifier)
    assert not result.correct and result.extracted == "3" and "gold" in result.reason
    missing = score_math("I think it is three.", {"answer": "3"}, verifier=verifier)
    assert not missing.correct and missing.extracted is None and missing.extractor == "none"


def test_a_hung_verification_scores_wrong_and_the_pool_recovers() -> None:
    with MathVerifier(timeout_s=3.0) as pool:
        slow = score_math("\\boxed{9^{9^{9^{9}}}}", {"answer": "2"}, verifier=pool)
        assert not slow.correct and "timed out" in slow.reason
        assert score_math("\\boxed{0.5}", {"answer": "\\frac12"}, verifier=pool).correct


def test_default_verifier_is_used_without_an_argument() -> None:
    assert score_math("\\boxed{\\dfrac{2}{4}}", {"answer": "\\frac{1}{2}"}).correct
