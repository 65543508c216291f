"""HumanEval and MBPP scorers: extract the code, run it with the tests in a sandbox, pass@1."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dlmc.bench.scorers.code_exec import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S, run_program
from dlmc.bench.scorers.result import ScoreResult
from dlmc.errors import ConfigError

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_BEGIN_DONE = re.compile(r"\[BEGIN\]\s*\n?(.*?)(?:\[DONE\]|\Z)", re.DOTALL)


def extract_code(text: str) -> tuple[str, str]:
    """The code in a response and the extractor used.

    In order: the first fenced ```python block; else the first fenced block of any language; else
    the text between ``[BEGIN]`` and ``[DONE]`` (MBPP few-shot format); else the raw text. An
    unclosed fence (a response cut at max tokens) runs to the end of the text.
    """
    blocks = _FENCE.findall(text)
    for tag, body in blocks:
        if tag.lower() in _PYTHON_TAGS:
            return body, "fenced_python_block"
    if blocks:
        return blocks[0][1], "fenced_block"
    match = _BEGIN_DONE.search(text)
    if match is not None:
        return match.group(1), "begin_done"
    return text, "raw"


def humaneval_program(code: str, row: Mapping[str, Any], *, raw_completion: bool = False) -> str:
    """The HumanEval test program: ``prompt + "\\n" + code`` (or ``prompt + completion`` for raw
    completions), then the row's ``test`` and ``check(entry_point)``."""
    prompt, test, entry = (_field(row, k, "HumanEval") for k in ("prompt", "test", "entry_point"))
    program = prompt + code if raw_completion else prompt + "\n" + code
    return f"{program}\n{test}\ncheck({entry})\n"


def mbpp_program(code: str, row: Mapping[str, Any]) -> str:
    """The MBPP test program: ``test_setup_code``, the code, then the three ``test_list`` asserts
    (``challenge_test_list`` is not used)."""
    tests = row.get("test_list")
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ConfigError("MBPP row: field 'test_list' must be a list of assert strings")
    setup = row.get("test_setup_code") or ""
    return f"{setup}\n{code}\n" + "\n".join(tests) + "\n"


def score_humaneval(
    response_text: str,
    problem_row: Mapping[str, Any],
    *,
    raw_completion: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
) -> ScoreResult:
    """Score a HumanEval response by running prompt + code + tests in a sandboxed subprocess.

    Args:
        response_text: the model's output (chat: a fenced block or the function; raw: the body).
        problem_row: a row of humaneval.jsonl.
        raw_completion: the response continues the prompt verbatim (raw prompting).
        timeout_s, memory_mb: sandbox limits (see `dlmc.bench.scorers.code_exec`).
    """
    if raw_completion:
        code, extractor = response_text, "raw_completion"
    else:
        code, extractor = extract_code(response_text)
    program = humaneval_program(code, problem_row, raw_completion=raw_completion)
    result = run_program(program, timeout_s=timeout_s, memory_mb=memory_mb)
    return ScoreResult(result.passed, code, extractor, result.reason)


def score_mbpp(
    response_text: str,
    problem_row: Mapping[str, Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
) -> ScoreResult:
    """Score an MBPP response by running setup + code + the three asserts in a sandbox."""
    code, extractor = extract_code(response_text)
    result = run_program(mbpp_program(code, problem_row), timeout_s=timeout_s, memory_mb=memory_mb)
    return ScoreResult(result.passed, code, extractor, result.reason)


def _field(row: Mapping[str, Any], key: str, benchmark: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise ConfigError(f"{benchmark} row: field {key!r} is missing or not a string")
    return value
