"""GSM8K scorer: gold parsing, last-number extraction, numeric comparison."""

from __future__ import annotations

from typing import Any

import pytest

from dlmc.bench import score_gsm8k
from dlmc.bench.scorers.gsm8k import extract_last_number, gsm8k_gold
from dlmc.errors import ConfigError


def _stated(row: dict[str, Any]) -> str:
    """The gold answer as written after '####' (commas kept)."""
    return row["answer"].rsplit("####", 1)[1].strip()


def test_gold_answers_are_integers_after_stripping(gsm8k_rows: list[dict[str, Any]]) -> None:
    golds = [gsm8k_gold(row) for row in gsm8k_rows]
    assert len(golds) == 1319
    assert all(g == int(g) for g in golds)
    assert sum("," in _stated(row) for row in gsm8k_rows) == 14
    assert sum(g < 0 for g in golds) == 2


@pytest.mark.parametrize("template", [
    "Let me work it out.\nSo the answer is {gold}.",
    "The total is ${gold}",
    "{gold}",
    "After 3 steps and 2.5 hours, we get **{gold}** dollars.",
    "#### {gold}",
    "The answer is \\boxed{{{gold}}}.",
])
def test_every_gold_is_extracted_from_a_response_that_states_it(
    gsm8k_rows: list[dict[str, Any]], template: str
) -> None:
    failures = [
        row["answer"][-30:] for row in gsm8k_rows
        if not score_gsm8k(template.format(gold=_stated(row)), row).correct
    ]
    assert failures == []


def test_wrong_answers_are_scored_wrong(gsm8k_rows: list[dict[str, Any]]) -> None:
    for row in gsm8k_rows:
        gold = gsm8k_gold(row)
        result = score_gsm8k(f"The answer is {int(gold) + 1}.", row)
        assert not result.correct and result.extracted == str(int(gold) + 1)
    no_number = score_gsm8k("I do not know.", gsm8k_rows[0])
    assert not no_number.correct and no_number.extracted is None and no_number.reason


def test_last_number_wins_and_is_normalised() -> None:
    row = {"answer": "...\n#### 1,450,000"}
    assert score_gsm8k("First 12, then 7. Total: $1,450,000.", row).correct
    assert not score_gsm8k("Total 1,450,000 then 12 more", row).correct
    assert extract_last_number("x = -3.50.") == "-3.50"
    assert extract_last_number("no digits") is None
    assert score_gsm8k("It is 18.0", {"answer": "#### 18"}).correct


def test_malformed_gold_names_the_field() -> None:
    with pytest.raises(ConfigError, match="'answer'"):
        gsm8k_gold({"answer": "no marker here"})
    with pytest.raises(ConfigError, match="'answer'"):
        gsm8k_gold({"question": "q"})
