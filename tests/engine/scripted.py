"""A stand-in model whose logits are scripted per round, for testing the decoder's rules."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

VOCAB, MASK, EOS = 10, 9, 8


def logits_for(tokens: list[int], probs: list[float]) -> torch.Tensor:
    """Logits `[n, VOCAB]` whose softmax puts probability p_i on tokens_i (rest spread evenly)."""
    rows = []
    for tok, p in zip(tokens, probs, strict=True):
        rest = (1.0 - p) / (VOCAB - 1)
        row = torch.full((VOCAB,), rest)
        row[tok] = p
        rows.append(row.log())
    return torch.stack(rows)


class ScriptedModel:
    """`script(call_index, tokens) -> logits [bl, VOCAB]` for denoising forwards."""

    def __init__(self, script: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.script = script
        self.calls = 0
        self.other_calls = 0  # forwards without logits (prefill, separate refresh)
        self.fused_calls = 0  # rounds that also carried the previous block's refresh
        self.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)

    def __call__(self, ids, positions, ctx, compute_logits: bool = True, logits_from: int = 0):
        if not compute_logits:
            self.other_calls += 1
            return None
        self.fused_calls += logits_from > 0
        logits = self.script(self.calls, ids[logits_from:].clone())
        self.calls += 1
        return logits
