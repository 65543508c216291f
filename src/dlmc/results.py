"""What `LLM.generate` returns and what `LLM.stream` yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dlmc.engine.events import CanvasRoundEvent, RoundEvent

__all__ = ["BlockChunk", "CanvasRoundEvent", "Done", "GenerateResult", "RoundEvent"]


@dataclass(frozen=True)
class GenerateResult:
    """One finished request."""

    text: str  # the answer, special tokens (EOS) removed
    token_ids: list[int]  # answer ids, including the EOS if one was produced
    prompt_token_ids: list[int]
    num_forwards: int  # denoising (decoder) forwards; prefill, encoder, refresh not counted
    total_forwards: int  # all forwards, prefill / encoder chunks and cache refreshes included
    tokens_per_forward: float  # len(token_ids) / num_forwards (DiffusionGemma: non-pad ids)
    request_tps: float  # len(token_ids) / elapsed_s
    elapsed_s: float
    finish_reason: str  # "stop" (EOS or a stop sequence), "length" (max_new_tokens), "cancelled"
    blocks: int
    settings: dict[str, Any] = field(default_factory=dict)  # effective decode settings
    stop_reason: str | None = None  # the stop sequence that ended the answer (not in `text`)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class BlockChunk:
    """A block (DiffusionGemma: an appended canvas) became final: its answer ids and the text
    they add. With stop sequences, text that may begin one waits for the next block, and a
    last chunk without ids carries it when the answer ends without one."""

    block_index: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Done:
    """The last event of a stream."""

    result: GenerateResult
