"""What the decoders report while they run: rounds (LLaDA2) or denoising steps
(DiffusionGemma), finished blocks or canvases, the end."""

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
class CanvasRoundEvent:
    """A DiffusionGemma canvas after one denoising step (for live views).

    `tokens` is the canvas the next step reads: where `accepted`, the token sampled at this
    step; elsewhere a fresh uniform-random id (re-noised). `argmax` is the step's most likely
    canvas, which is what the canvas appends if it stops here.
    """

    canvas_index: int
    round_index: int  # 1-based step within the canvas
    steps_remaining: int  # n of the temperature schedule: max_denoising_steps .. 1
    tokens: tuple[int, ...]
    accepted: tuple[bool, ...]  # kept its sample; False: re-noised
    argmax: tuple[int, ...]
    mean_entropy: float  # nats, of the tempered distribution, over the canvas
    stopped: bool  # stable and confident: the canvas ends with this step


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
    # tokens per forward as the model's reference reports it, where it differs from
    # len(answer_ids) / num_forwards (DiffusionGemma: pad ids in the answer do not count)
    tokens_per_forward: float | None = None
