"""Rich live view of a block being denoised: masks as placeholders, commits and edits marked;
for DiffusionGemma, the canvas being denoised with accepted and re-noised positions apart."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text

from dlmc.engine.events import CanvasRoundEvent, RoundEvent
from dlmc.results import GenerateResult

MASK_GLYPH = "░"


def render_block(
    text_so_far: str, event: RoundEvent | None, token_text: Callable[[int], str]
) -> Text:
    """Finished text, then the current block: prompt dim, masks as ░, new commits green,
    edits yellow underlined, older tokens plain; a status line below."""
    out = Text(text_so_far)
    if event is None:
        return out
    for tok, prompt, masked, committed, edited in zip(
        event.tokens, event.is_prompt, event.is_masked, event.committed, event.edited, strict=True
    ):
        if prompt:
            continue
        if masked:
            out.append(MASK_GLYPH, style="grey50")
        elif edited:
            out.append(_visible(token_text(tok)), style="bold yellow underline")
        elif committed:
            out.append(_visible(token_text(tok)), style="bold green")
        else:
            out.append(_visible(token_text(tok)), style="cyan")
    remaining = sum(event.is_masked)
    out.append(
        f"\n[block {event.block_index} · round {event.round_index} · {remaining} masked · "
        f"+{sum(event.committed)} committed · {sum(event.edited)} edited]",
        style="dim",
    )
    return out


def render_canvas(
    text_so_far: str, event: CanvasRoundEvent, token_text: Callable[[int], str]
) -> Text:
    """Finished text, then the canvas after a denoising step: accepted tokens (this step's
    samples) bold green, re-noised positions (fresh random tokens) dim and struck through;
    a status line below."""
    out = Text(text_so_far)
    for tok, accepted in zip(event.tokens, event.accepted, strict=True):
        piece = _visible(token_text(tok)) or "·"
        out.append(piece, style="bold green" if accepted else "grey42 strike")
    kept = sum(event.accepted)
    out.append(
        f"\n[canvas {event.canvas_index} · step {event.round_index} "
        f"({event.steps_remaining} left) · {kept} accepted · {len(event.tokens) - kept} "
        f"re-noised · mean entropy {event.mean_entropy:.3f}"
        f"{' · stopped' if event.stopped else ''}]",
        style="dim",
    )
    return out


def _visible(piece: str) -> str:
    return piece.replace("\n", "↵") if piece.strip() or not piece else piece


def stats_line(result: GenerateResult) -> str:
    return (
        f"{len(result.token_ids)} tokens · {result.num_forwards} forwards · "
        f"TPF {result.tokens_per_forward:.2f} · {result.request_tps:.1f} tokens/s · "
        f"{result.elapsed_s:.2f} s · finish: {result.finish_reason}"
        + (f" at {result.stop_reason!r}" if result.stop_reason is not None else "")
    )
