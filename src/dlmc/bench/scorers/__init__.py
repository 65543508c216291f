"""The papers' scorers: GSM8K, MATH-500, HumanEval and MBPP (see docs/eval.md)."""

from dlmc.bench.scorers.code import score_humaneval, score_mbpp
from dlmc.bench.scorers.gsm8k import score_gsm8k
from dlmc.bench.scorers.math500 import score_math
from dlmc.bench.scorers.result import ScoreResult

__all__ = ["ScoreResult", "score_gsm8k", "score_humaneval", "score_math", "score_mbpp"]
