"""Prompts per benchmark: zero-shot chat by default, few-shot following docs/eval.md.

Two styles: ``chat`` (messages rendered by the model's chat template; instruct models) and ``raw``
(plain text continued by the model; base models). ``few_shot`` adds the papers' exemplars: MBPP
3-shot from task_ids 2, 3, 4 of the problem file; GSM8K and MATH from an exemplar file the user
gives (the harness sets, lm-eval ``gsm8k``/``minerva_math`` or OpenCompass ``gsm8k_gen``, are not
vendored); HumanEval is always 0-shot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dlmc.bench.problems import ProblemSet
from dlmc.errors import ConfigError

PromptStyle = Literal["chat", "raw"]

GSM8K_INSTRUCTION = "{question}\nPlease reason step by step, and put your final answer at the end."
MATH_INSTRUCTION = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function, signature "
    "included, in one ```python code block.\n\n```python\n{prompt}```"
)
MBPP_TASK = (
    "You are an expert Python programmer, and here is your task: {text} Your code should pass "
    "these tests:\n\n{tests}\n"
)
MBPP_CHAT_SUFFIX = "Write your solution in one ```python code block."
MBPP_SHOT_IDS = (2, 3, 4)
HUMANEVAL_RAW_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MINERVA_FINAL = "Final Answer: The final answer is ${answer}$. I hope it is correct."


@dataclass(frozen=True)
class Prompt:
    """One rendered prompt.

    Attributes:
        messages: chat turns (``chat`` style), rendered by the engine with the chat template.
        text: plain text (``raw`` style).
        stop: strings at which the output is cut before scoring (the engine has no stop strings).
        raw_completion: the output continues the prompt verbatim (HumanEval raw).
    """

    messages: tuple[dict[str, str], ...] | None
    text: str | None
    stop: tuple[str, ...] = ()
    raw_completion: bool = False

    def as_record(self) -> Any:
        """The prompt as stored in the per-problem JSONL."""
        return list(self.messages) if self.messages is not None else self.text


@dataclass(frozen=True)
class PromptPlan:
    """How a benchmark is prompted and scored, as the report states it."""

    shots: int
    exemplars: str
    style: PromptStyle
    instruction: str
    extractor: str


def plan_prompts(
    problems: ProblemSet,
    style: PromptStyle,
    few_shot: bool,
    exemplar_rows: Sequence[dict[str, Any]] | None = None,
    exemplar_source: str = "",
) -> tuple[PromptPlan, tuple[dict[str, Any], ...]]:
    """The plan for a problem set and its exemplar rows; errors name the missing option."""
    bench = problems.benchmark
    shots: tuple[dict[str, Any], ...] = ()
    source = "none"
    if few_shot and bench == "mbpp":
        by_id = {row["task_id"]: row for row in problems.all_rows}
        missing = [i for i in MBPP_SHOT_IDS if i not in by_id]
        if missing:
            raise ConfigError(f"{problems.path}: MBPP few-shot needs task_ids {missing}")
        shots, source = tuple(by_id[i] for i in MBPP_SHOT_IDS), "MBPP task_ids 2, 3, 4"
    elif few_shot and bench in ("gsm8k", "math500"):
        if not exemplar_rows:
            raise ConfigError(
                f"--few-shot for {bench} needs --exemplars {bench}=FILE (JSONL rows in the format "
                f"of {problems.path.name}, e.g. the lm-eval/OpenCompass exemplar set)"
            )
        tests = {_question(bench, p.row) for p in problems.problems}
        overlap = [r for r in exemplar_rows if _question(bench, r) in tests]
        if overlap:
            raise ConfigError(f"{exemplar_source}: {len(overlap)} exemplar(s) are test rows")
        shots, source = tuple(exemplar_rows), exemplar_source
    instruction = {
        "gsm8k": GSM8K_INSTRUCTION if style == "chat" else "Question: {question}\nAnswer:",
        "math500": MATH_INSTRUCTION if style == "chat" else "Problem:\n{problem}\n\nSolution:",
        "humaneval": HUMANEVAL_INSTRUCTION if style == "chat" else "{prompt}",
        "mbpp": MBPP_TASK + (MBPP_CHAT_SUFFIX if style == "chat" and not shots else ""),
    }[bench]
    extractor = {
        "gsm8k": "last number (-?[\\d,]*\\.?\\d+), ',' '$' stripped",
        "math500": "last \\boxed{} (fallback: 'final answer is' sentence); math-verify",
        "humaneval": "first ```python block, else raw" if style == "chat" else "raw completion",
        "mbpp": "first ```python block, else [BEGIN]..[DONE], else raw",
    }[bench]
    plan = PromptPlan(len(shots), source, style, instruction, extractor)
    return plan, shots


def build_prompt(
    benchmark: str, row: dict[str, Any], plan: PromptPlan, shots: Sequence[dict[str, Any]]
) -> Prompt:
    """The prompt for one problem row under ``plan``."""
    pairs = [(_user_text(benchmark, s, plan), _shot_answer(benchmark, s)) for s in shots]
    user = _user_text(benchmark, row, plan)
    stop = _stops(benchmark, plan)
    if plan.style == "chat":
        turns: list[dict[str, str]] = []
        for question, answer in pairs:
            turns += [{"role": "user", "content": question},
                      {"role": "assistant", "content": answer}]
        turns.append({"role": "user", "content": user})
        return Prompt(tuple(turns), None, stop)
    text = "".join(f"{q} {a}\n\n" if benchmark == "gsm8k" else f"{q}\n{a}\n\n" for q, a in pairs)
    if benchmark == "mbpp":
        user += "\n[BEGIN]\n"
    return Prompt(None, text + user, stop, raw_completion=benchmark == "humaneval")


def _user_text(benchmark: str, row: dict[str, Any], plan: PromptPlan) -> str:
    if benchmark == "mbpp":
        tests = "\n".join(row["test_list"])
        return plan.instruction.format(text=row["text"], tests=tests)
    return plan.instruction.format(**{k: v for k, v in row.items() if isinstance(v, str)})


def _shot_answer(benchmark: str, row: dict[str, Any]) -> str:
    if benchmark == "mbpp":
        return "[BEGIN]\n" + row["code"].replace("\r\n", "\n") + "\n[DONE]"
    if benchmark == "math500":
        return row["solution"] + "\n" + MINERVA_FINAL.format(answer=row["answer"])
    return str(row["answer"])


def _stops(benchmark: str, plan: PromptPlan) -> tuple[str, ...]:
    if benchmark == "humaneval" and plan.style == "raw":
        return HUMANEVAL_RAW_STOPS
    if benchmark == "mbpp" and (plan.shots or plan.style == "raw"):
        return ("[DONE]",)
    if benchmark == "gsm8k" and (plan.shots or plan.style == "raw"):
        return ("Question:",)
    if benchmark == "math500" and (plan.shots or plan.style == "raw"):
        return ("Problem:",)
    return ()


def _question(benchmark: str, row: dict[str, Any]) -> str:
    return str(row.get("question" if benchmark == "gsm8k" else "problem", "")).strip()


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for s in stop:
        index = text.find(s)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]
