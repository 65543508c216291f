"""HumanEval and MBPP scorers on the gold data: reference code passes, wrong code fails."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from dlmc.bench import score_humaneval, score_mbpp
from dlmc.bench.problems import MBPP_TEST_IDS
from dlmc.bench.scorers.code import extract_code, humaneval_program, mbpp_program
from dlmc.bench.scorers.code_exec import run_programs

# Reference solutions that fail the shipped tests under the docs/eval.md program layout
# (test_setup_code, then the code): the setup builds `Node` objects before the code defines it.
MBPP_SETUP_BEFORE_CLASS = {367, 927}
MBPP_SAMPLE = range(11, 511, 25)  # 20 tasks spread over the test split


def _negated(line: str) -> str:
    """An ``assert`` line with its condition negated: a solution that passes it fails this."""
    node = ast.parse(line).body[0]
    assert isinstance(node, ast.Assert), line
    node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    return ast.unparse(node)


def _fenced(code: str) -> str:
    return "```python\n" + code + "\n```"


def test_every_humaneval_canonical_solution_passes(humaneval_rows: list[dict[str, Any]]) -> None:
    programs = [humaneval_program(r["canonical_solution"], r) for r in humaneval_rows]
    results = run_programs(programs, timeout_s=60.0)  # correctness here, not speed (see below)
    failed = [(r["task_id"], x.reason) for r, x in zip(humaneval_rows, results, strict=True)
              if not x.passed]
    assert (len(humaneval_rows) - len(failed), failed) == (164, [])


def test_humaneval_wrong_solutions_fail(humaneval_rows: list[dict[str, Any]]) -> None:
    stub = "    return None\n"
    results = run_programs([humaneval_program(stub, r) for r in humaneval_rows])
    passed = [r["task_id"] for r, x in zip(humaneval_rows, results, strict=True) if x.passed]
    assert passed == []


def test_mbpp_reference_code_passes_its_tests(mbpp_rows: list[dict[str, Any]]) -> None:
    # The data and the program layout are under test here, not speed: task 123's reference needs
    # ~3 s on an idle 2-core box and took over 10 s (OpenCompass's timeout) on a loaded CI runner.
    results = run_programs([mbpp_program(r["code"], r) for r in mbpp_rows], timeout_s=120.0)
    failed = {r["task_id"]: x.reason for r, x in zip(mbpp_rows, results, strict=True)
              if not x.passed}
    assert set(failed) == MBPP_SETUP_BEFORE_CLASS, failed
    assert all("NameError" in reason and "Node" in reason for reason in failed.values())
    assert sum(r["task_id"] in MBPP_TEST_IDS for r in mbpp_rows if r["task_id"] in failed) == 1


def test_every_assert_of_the_test_list_runs(mbpp_rows: list[dict[str, Any]]) -> None:
    # The reference passes its three asserts; negating any one of them must make it fail.
    cases = [(row, i) for row in mbpp_rows if row["task_id"] in MBPP_SAMPLE
             for i in range(len(row["test_list"]))]
    assert len(cases) == 60
    programs = [
        mbpp_program(row["code"], {**row, "test_list": [
            _negated(t) if j == i else t for j, t in enumerate(row["test_list"])]})
        for row, i in cases
    ]
    results = run_programs(programs, timeout_s=60.0)
    passed = [(row["task_id"], i) for (row, i), x in zip(cases, results, strict=True) if x.passed]
    assert passed == []
    assert all("AssertionError" in x.reason for x in results), [x.reason for x in results]
    row = next(r for r in mbpp_rows if r["task_id"] == 11)
    last_fails = {**row, "test_list": [*row["test_list"][:2], _negated(row["test_list"][2])]}
    result = score_mbpp(_fenced(row["code"]), last_fails)
    assert not result.correct and "AssertionError" in result.reason


def test_test_setup_code_runs_first(mbpp_rows: list[dict[str, Any]]) -> None:
    # Task 367's asserts use trees its setup builds; with the Node class moved into the setup
    # (its reference defines Node after the setup has run), the reference passes.
    row = next(r for r in mbpp_rows if r["task_id"] == 367)
    node_class, rest = row["code"].split("def get_height", 1)
    fixed = {**row, "test_setup_code": node_class + row["test_setup_code"]}
    assert score_mbpp(_fenced("def get_height" + rest), fixed).correct
    without_setup = score_mbpp(_fenced(row["code"]), {**row, "test_setup_code": ""})
    assert not without_setup.correct and "name 'root' is not defined" in without_setup.reason
    as_shipped = score_mbpp(_fenced(row["code"]), row)
    assert not as_shipped.correct and "name 'Node' is not defined" in as_shipped.reason


def test_challenge_tests_are_not_run(mbpp_rows: list[dict[str, Any]]) -> None:
    # docs/eval.md: `challenge_test_list` is not used. Its asserts negated, the references pass.
    rows = [r for r in mbpp_rows if r["challenge_test_list"]]
    assert [r["task_id"] for r in rows] == [11, 16, 20, 23, 25, 26, 28, 42, 43, 44, 47]
    broken = [{**r, "challenge_test_list": [_negated(t) for t in r["challenge_test_list"]]}
              for r in rows]
    results = run_programs([mbpp_program(r["code"], r) for r in broken], timeout_s=60.0)
    assert [r["task_id"] for r, x in zip(rows, results, strict=True) if not x.passed] == []


def test_chat_style_responses_through_the_public_scorers(
    humaneval_rows: list[dict[str, Any]], mbpp_rows: list[dict[str, Any]]
) -> None:
    row = humaneval_rows[0]
    fenced = "Here you go:\n```python\n" + row["prompt"] + row["canonical_solution"] + "```\nDone."
    result = score_humaneval(fenced, row)
    assert result.correct and result.extractor == "fenced_python_block"
    body_only = score_humaneval(row["canonical_solution"], row)
    assert body_only.correct and body_only.extractor == "raw"
    raw = score_humaneval(row["canonical_solution"], row, raw_completion=True)
    assert raw.correct and raw.extractor == "raw_completion"
    mbpp = next(r for r in mbpp_rows if r["task_id"] == 11)
    assert score_mbpp("```python\n" + mbpp["code"] + "\n```", mbpp).correct
    assert score_mbpp("[BEGIN]\n" + mbpp["code"] + "\n[DONE]", mbpp).correct
    wrong = score_mbpp("```python\ndef remove_Occ(s, ch):\n    return s\n```", mbpp)
    assert not wrong.correct and "AssertionError" in wrong.reason


def test_a_looping_solution_is_stopped_and_scored_wrong(humaneval_rows: list[dict[str, Any]]):
    row = humaneval_rows[0]
    result = score_humaneval("    while True:\n        pass\n", row, timeout_s=1.0)
    assert not result.correct and "timed out" in result.reason
    bomb = "    x = []\n    while True:\n        x.append(bytearray(50 * 2**20))\n"
    result = score_humaneval(bomb, row, memory_mb=256, timeout_s=10.0)
    assert not result.correct and "MemoryError" in result.reason


@pytest.mark.parametrize(("text", "code", "extractor"), [
    ("```python\nA\n```\n```python\nB\n```", "A\n", "fenced_python_block"),
    ("```\nA\n```", "A\n", "fenced_block"),
    ("```text\nT\n```\n```py\nP\n```", "P\n", "fenced_python_block"),
    ("```python\ncut off by max tokens", "cut off by max tokens", "fenced_python_block"),
    ("[BEGIN]\nX\n[DONE] trailing", "X\n", "begin_done"),
    ("def f():\n    return 1", "def f():\n    return 1", "raw"),
])
def test_extract_code(text: str, code: str, extractor: str) -> None:
    assert extract_code(text) == (code, extractor)
