"""What the block decoder reports while it runs: rounds, finished blocks, the end."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundEvent:
    """State of the current block after one denoising round (for live views)."""

    block_index: int
    round_index: int
    tokens: tuple[int, ...]  # the block's token ids after this round
    is_prompt: tuple[bool, ...]  # prompt positions inside the block (never decoded)
    is_masked: tuple[bool, ...]  # still masked after this round
    committed: tuple[bool, ...]  # mask -> token in this round
    edited: tuple[bool, ...]  # token -> other token in this round


@dataclass(frozen=True)
class BlockEvent:
    """A block is final; `answer_ids` are the answer tokens it adds (cut at EOS / max length)."""

    block_index: int
    answer_ids: tuple[int, ...]
    rounds: int


@dataclass(frozen=True)
class DecodeOutput:
    """The decoder's result in token ids and counts."""

    answer_ids: tuple[int, ...]  # up to and including the first EOS
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens) or "cancelled"
    num_forwards: int  # denoising forwards (drive commit/edit decisions)
    total_forwards: int  # plus prefill chunks and cache-refresh forwards
    blocks: int
    fused_rounds: int = 0  # rounds that also refreshed the previous block (2-block forwards)
