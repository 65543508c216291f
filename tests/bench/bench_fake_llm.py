"""A stand-in for `dlmc.LLM` with the same `generate` signature, answering from the gold data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class FakeResult:
    """The fields of the engine's GenerateResult the suite reads."""

    text: str
    token_ids: list[int]
    num_forwards: int
    tokens_per_forward: float
    request_tps: float
    elapsed_s: float
    finish_reason: str
    settings: dict[str, Any]


def gold_response(row: dict[str, Any]) -> str:
    """A correct chat-style response for a row of any of the four benchmarks."""
    if "entry_point" in row:
        return "```python\n" + row["prompt"] + row["canonical_solution"] + "```"
    if "test_list" in row:
        return "Sure.\n```python\n" + row["code"] + "\n```"
    if "problem" in row:
        return f"Reasoning... so the answer is $\\boxed{{{row['answer']}}}$."
    return "Step by step... The answer is " + row["answer"].rsplit("####", 1)[1].strip() + "."


@dataclass
class FakeLLM:
    """Answers the problems of ``rows`` correctly, except those whose key is in ``wrong_keys``
    (a wrong number) or ``overrides`` (the given text)."""

    rows: list[dict[str, Any]]
    wrong_keys: set[str] = field(default_factory=set)
    overrides: dict[str, str] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    model_id: str = "fake"
    checked: list[dict[str, Any]] = field(default_factory=list)

    def decode_settings(self, **overrides: Any) -> dict[str, Any]:
        """Records the settings the suite checks before its first problem."""
        self.checked.append(overrides)
        return overrides

    def generate(
        self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None, max_new_tokens: int = 256,
        threshold: float | None = None, edit_threshold: Any = ...,
        max_refine_steps: int | None = None, block_length: int | None = None,
        temperature: float = 0.0, seed: int | None = None,
    ) -> FakeResult:
        text = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [])
        self.calls.append({"text": text, "max_new_tokens": max_new_tokens, "threshold": threshold,
                           "edit_threshold": edit_threshold, "seed": seed})
        row = next(r for r in self.rows if key_of(r) in text)
        answer = "I am not sure: 1234567." if key_of(row) in self.wrong_keys else gold_response(row)
        answer = self.overrides.get(key_of(row), answer)
        tokens = list(range(len(answer.split()) + 3))
        return FakeResult(answer, tokens, num_forwards=2, tokens_per_forward=len(tokens) / 2,
                          request_tps=len(tokens) / 0.5, elapsed_s=0.5, finish_reason="stop",
                          settings={"threshold": threshold, "block_length": 32})


def key_of(row: dict[str, Any]) -> str:
    """The text of a row that its prompt always contains."""
    for name in ("prompt", "text", "problem", "question"):
        if name in row:
            return str(row[name])
    raise KeyError(row)
