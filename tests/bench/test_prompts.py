"""Prompts: zero-shot chat instructions, few-shot conventions, raw style, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlmc.bench.problems import load_problem_set
from dlmc.bench.prompts import build_prompt, cut_at_stop, plan_prompts
from dlmc.errors import ConfigError


def _first_prompt(data_dir: Path, file: str, style: str = "chat", few_shot: bool = False):
    problems = load_problem_set(str(data_dir / file), limit=1)
    plan, shots = plan_prompts(problems, style, few_shot)  # type: ignore[arg-type]
    return problems, plan, build_prompt(problems.benchmark, problems.problems[0].row, plan, shots)


def test_zero_shot_chat_is_one_user_turn_with_the_instruction(data_dir: Path) -> None:
    problems, plan, prompt = _first_prompt(data_dir, "math500.jsonl")
    assert plan.shots == 0 and plan.style == "chat" and prompt.text is None
    assert prompt.messages is not None and len(prompt.messages) == 1
    content = prompt.messages[0]["content"]
    assert content.startswith(problems.problems[0].row["problem"])
    assert content.endswith("put your final answer within \\boxed{}.")
    _, _, code = _first_prompt(data_dir, "humaneval.jsonl")
    assert code.messages is not None and "```python" in code.messages[0]["content"]
    _, _, mbpp = _first_prompt(data_dir, "mbpp.jsonl")
    assert mbpp.messages is not None
    assert "Your code should pass these tests" in mbpp.messages[0]["content"]
    assert "```python code block" in mbpp.messages[0]["content"] and mbpp.stop == ()


def test_mbpp_few_shot_uses_task_ids_2_3_4(data_dir: Path) -> None:
    _, plan, prompt = _first_prompt(data_dir, "mbpp.jsonl", few_shot=True)
    assert plan.shots == 3 and "2, 3, 4" in plan.exemplars
    assert prompt.messages is not None and len(prompt.messages) == 7
    assert prompt.messages[1]["content"].startswith("[BEGIN]\n")
    assert prompt.messages[1]["content"].endswith("[DONE]") and prompt.stop == ("[DONE]",)
    _, _, raw = _first_prompt(data_dir, "mbpp.jsonl", style="raw", few_shot=True)
    assert raw.text is not None and raw.text.count("[DONE]") == 3
    assert raw.text.endswith("[BEGIN]\n")


def test_gsm8k_and_math_few_shot_need_exemplars_from_outside_the_test_rows(
    data_dir: Path, tmp_path: Path
) -> None:
    problems = load_problem_set(str(data_dir / "gsm8k.jsonl"), limit=5)
    with pytest.raises(ConfigError, match="--exemplars gsm8k=FILE"):
        plan_prompts(problems, "chat", True)
    test_row = problems.problems[0].row
    with pytest.raises(ConfigError, match="exemplar"):
        plan_prompts(problems, "chat", True, [test_row], "ex.jsonl")
    shot = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"}
    plan, shots = plan_prompts(problems, "raw", True, [shot], "ex.jsonl")
    prompt = build_prompt("gsm8k", test_row, plan, shots)
    assert plan.shots == 1 and prompt.text is not None and prompt.stop == ("Question:",)
    assert prompt.text.startswith("Question: Tom has 2 apples")
    assert prompt.text.endswith(test_row["question"] + "\nAnswer:")


def test_humaneval_raw_is_the_prompt_itself_with_the_stops(data_dir: Path) -> None:
    problems, _, prompt = _first_prompt(data_dir, "humaneval.jsonl", style="raw")
    assert prompt.text == problems.problems[0].row["prompt"] and prompt.raw_completion
    assert "\ndef" in prompt.stop
    assert cut_at_stop("    return 1\ndef g():\n    pass\n", prompt.stop) == "    return 1"
    assert cut_at_stop("no stop here", ("X",)) == "no stop here"
