"""The live views: a LLaDA2 block (masks, commits, edits) and a DiffusionGemma canvas
(accepted samples apart from re-noised positions)."""

import dataclasses

from dlmc.cli.live import MASK_GLYPH, render_block, render_canvas, stats_line
from dlmc.engine.events import CanvasRoundEvent, RoundEvent
from dlmc.results import GenerateResult


def _styles(text) -> dict[str, str]:
    """Each styled span's text -> its style."""
    return {text.plain[span.start:span.end]: str(span.style) for span in text.spans}


def test_canvas_view_marks_accepted_and_renoised_positions():
    pieces = {10: "A", 11: "b", 12: "C", 13: "d\n"}
    event = CanvasRoundEvent(canvas_index=1, round_index=3, steps_remaining=46,
                             tokens=(10, 11, 12, 13), accepted=(True, False, True, False),
                             argmax=(10, 10, 12, 12), mean_entropy=0.25, stopped=False)
    out = render_canvas("so far ", event, pieces.__getitem__)
    assert out.plain.startswith("so far AbCd↵\n[canvas 1 · step 3 (46 left) · 2 accepted · "
                                "2 re-noised · mean entropy 0.250]")
    styles = _styles(out)
    assert styles["A"] == styles["C"] == "bold green"
    assert styles["b"] == styles["d↵"] == "grey42 strike"
    stopped = render_canvas("", event.__class__(**{**event.__dict__, "stopped": True}),
                            pieces.__getitem__)
    assert stopped.plain.endswith("· stopped]")


def test_block_view_marks_masks_commits_and_edits():
    event = RoundEvent(block_index=0, round_index=2, tokens=(1, 5, 6, 9),
                       is_prompt=(True, False, False, False),
                       is_masked=(False, False, False, True), committed=(False, True, False, False),
                       edited=(False, False, True, False))
    out = render_block("", event, lambda t: {5: "x", 6: "y", 9: "?"}[t])
    assert out.plain.startswith(f"xy{MASK_GLYPH}\n[block 0 · round 2 · 1 masked")
    styles = _styles(out)
    assert styles["x"] == "bold green" and styles["y"] == "bold yellow underline"


def test_the_stats_line_names_the_finish_and_the_stop_sequence():
    result = GenerateResult(text="4", token_ids=[52, 10], prompt_token_ids=[1], num_forwards=4,
                            total_forwards=5, tokens_per_forward=0.5, request_tps=20.0,
                            elapsed_s=0.1, finish_reason="stop", blocks=1, stop_reason="\n")
    assert stats_line(result) == ("2 tokens · 4 forwards · TPF 0.50 · 20.0 tokens/s · 0.10 s · "
                                  "finish: stop at '\\n'")
    eos = dataclasses.replace(result, stop_reason=None)
    assert stats_line(eos).endswith("finish: stop")
