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
        self.other_calls = 0
        self.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)

    def __call__(self, ids, positions, ctx, compute_logits: bool = True):
        if not compute_logits:
            self.other_calls += 1
            return None
        logits = self.script(self.calls, ids.clone())
        self.calls += 1
        return logits
