"""The result every scorer returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoreResult:
    """How one response was scored.

    Attributes:
        correct: whether the response counts as correct (pass@1 for code).
        extracted: the answer (or code) taken from the response; ``None`` when nothing was found.
        extractor: which extractor produced ``extracted`` (e.g. ``"last_number"``, ``"boxed"``,
            ``"final_answer_sentence"``, ``"fenced_block"``, ``"raw"``, ``"none"``).
        reason: a short human-readable reason when ``correct`` is false (empty when correct).
    """

    correct: bool
    extracted: str | None
    extractor: str
    reason: str = ""
