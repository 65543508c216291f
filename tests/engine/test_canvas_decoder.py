"""DiffusionGemma's canvas decoder against transformers' `generate` on tiny random models (CPU,
fp32): the same seed gives the same tokens, the same accepted positions at every step, the
same stopping step per canvas and the same tokens per forward, in both eager strategies; the
cached decoding equals a whole-sequence recompute and the prompt's chunking does not matter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from dlmc.engine.canvas_config import CanvasDecodeConfig  # noqa: E402
from dlmc.engine.canvas_decoder import CanvasDecoder  # noqa: E402
from dlmc.engine.events import BlockEvent, CanvasRoundEvent  # noqa: E402
from dlmc.errors import ConfigError  # noqa: E402
from dlmc.loading.loader import load_model  # noqa: E402
from tests.engine.gemma_models import (  # noqa: E402
    CANVAS,
    SETTINGS,
    hf_gemma,
    hf_generate,
    save_checkpoint,
)

CPU = torch.device("cpu")
PROMPT = [2, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]  # longer than the sliding window


@pytest.fixture(scope="module", params=[0, 1], ids=["model0", "model1"])
def pair(request, tmp_path_factory):
    """(transformers' model, dlmc's model loaded from its saved checkpoint)."""
    reference = hf_gemma(request.param)
    path = save_checkpoint(reference, tmp_path_factory.mktemp(f"gemma{request.param}"))
    return reference, load_model(path, CPU, torch.float32).model


def run(decoder: CanvasDecoder, cfg: CanvasDecodeConfig, prompt: list[int] = PROMPT, **kw):
    """(DecodeOutput, the events)."""
    events = []
    steps = decoder.decode(prompt, cfg, rounds=True, **kw)
    while True:
        try:
            events.append(next(steps))
        except StopIteration as stop:
            return stop.value, events


def accepted_per_canvas(events) -> list[list[list[bool]]]:
    rounds = [e for e in events if isinstance(e, CanvasRoundEvent)]
    canvases = sorted({e.canvas_index for e in rounds})
    return [[list(e.accepted) for e in rounds if e.canvas_index == c] for c in canvases]


@pytest.mark.parametrize(("mode", "seed"), [("eager", 0), ("eager", 1), ("eager", 2),
                                           ("eager", 3), ("reference", 0), ("reference", 3)])
def test_generate_is_token_identical_to_transformers(pair, mode, seed):
    reference, model = pair
    want, want_tpf, want_accepted = hf_generate(reference, PROMPT, seed)
    out, events = run(CanvasDecoder(model, CPU, mode), CanvasDecodeConfig(SETTINGS, seed))
    assert list(out.answer_ids) == want
    got_accepted = accepted_per_canvas(events)
    assert got_accepted == want_accepted  # every step's decisions, so every stopping step
    assert out.num_forwards == sum(len(c) for c in want_accepted)
    assert out.tokens_per_forward == pytest.approx(want_tpf, rel=1e-6)
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    assert [len(c) for c in want_accepted] == [b.rounds for b in blocks]
    assert sum((list(b.answer_ids) for b in blocks), []) == want
    eos = set(SETTINGS.eos_token_ids)
    assert out.finish_reason == ("stop" if eos & set(want) else "length")


def test_the_case_covers_early_stops_eos_and_several_canvases(pair):
    """What the parity test above must exercise to mean anything."""
    reference, _ = pair
    runs = [hf_generate(reference, PROMPT, seed) for seed in range(4)]
    steps = {len(c) for _, _, canvases in runs for c in canvases}
    assert min(steps) < SETTINGS.max_denoising_steps  # canvases stop before the last step
    assert len(steps) > 2  # at different steps
    assert any(set(ids) & set(SETTINGS.eos_token_ids) for ids, _, _ in runs)
    assert any(len(canvases) == 3 for _, _, canvases in runs)
    accepted = [sum(m) for _, _, canvases in runs for c in canvases for m in c]
    assert min(accepted) >= 1 and max(accepted) > 1


def test_released_stopping_rule_is_token_identical(pair):
    """stability_threshold 1 and the released confidence threshold: every canvas runs all
    its steps, and the stopping test must never fire early."""
    reference, model = pair
    s = dataclasses.replace(SETTINGS, stability_threshold=1, confidence_threshold=0.005)
    want, _, want_accepted = hf_generate(reference, PROMPT, 5, s)
    out, events = run(CanvasDecoder(model, CPU, "eager"), CanvasDecodeConfig(s, 5))
    assert list(out.answer_ids) == want and accepted_per_canvas(events) == want_accepted


@pytest.mark.parametrize(("mode", "seeds"), [("eager", (1, 2)), ("reference", (3,))])
def test_cached_decoding_equals_whole_sequence_recompute(pair, mode, seeds):
    _, model = pair
    decoder = CanvasDecoder(model, CPU, mode)
    for seed in seeds:
        cached, cached_events = run(decoder, CanvasDecodeConfig(SETTINGS, seed))
        recomputed, events = run(decoder, CanvasDecodeConfig(SETTINGS, seed), use_cache=False)
        assert recomputed.answer_ids == cached.answer_ids and len(events) == len(cached_events)
        # entropies to the rounding of fp32 logits up to 30 / t_min = 75 in size
        for got, want in zip(events, cached_events, strict=True):
            if isinstance(got, CanvasRoundEvent):
                assert got.mean_entropy == pytest.approx(want.mean_entropy, rel=1e-3)
                got = dataclasses.replace(got, mean_entropy=want.mean_entropy)
            assert got == want
        assert cached.blocks > 1  # the cache held appended canvases, not only the prompt


@pytest.mark.parametrize("pieces", [[21], [5, 16], [1] * 21])
def test_cached_logits_equal_a_recompute(pair, pieces):
    """The decoder's logits over the incremental cache (filled in `pieces`, which the sliding
    window crosses) equal those over a cache rebuilt from the whole clean sequence, to 1e-5 of
    their largest magnitude. The first step of a canvas: later steps feed these logits back
    through self-conditioning, which amplifies any difference (the decoding test above checks
    that they still take the same decisions)."""
    _, model = pair
    from dlmc.engine.canvas_steppers import EagerCanvasStepper

    clean = torch.tensor(PROMPT + list(range(60, 60 + CANVAS)))  # prompt + an appended canvas
    canvas = torch.randint(0, 96, (1, CANVAS), generator=torch.Generator().manual_seed(0))
    tempered = []
    for use_cache in (True, False):
        stepper = EagerCanvasStepper(model, CPU, use_cache)
        stepper.reset(SETTINGS, len(clean))
        start = 0
        for size in pieces:
            stepper.encode(clean[start:start + size], start)
            start += size
        stepper.begin_canvas(canvas, len(clean))
        tempered.append(stepper.step(8, torch.Generator().manual_seed(3)).tempered)
    cached, recomputed = tempered
    assert (cached - recomputed).abs().max() <= 1e-5 * recomputed.abs().max()


def test_prompt_chunking_does_not_change_the_tokens(pair):
    _, model = pair
    cfg = CanvasDecodeConfig(SETTINGS, 2)
    whole, _ = run(CanvasDecoder(model, CPU, "eager"), cfg)
    chunked, _ = run(CanvasDecoder(model, CPU, "eager", prefill_chunk=4), cfg)
    assert chunked.answer_ids == whole.answer_ids
    # encoder passes: the prompt's 13 tokens in 4, each encoded canvas of 8 in 2
    assert chunked.total_forwards - chunked.num_forwards == 4 + 2 * (chunked.blocks - 1)


def test_cancel_keeps_only_finished_canvases(pair):
    _, model = pair
    cfg = CanvasDecodeConfig(dataclasses.replace(SETTINGS, eos_token_ids=()), 1)
    full, events = run(CanvasDecoder(model, CPU, "eager"), cfg)
    assert full.blocks >= 2
    first_canvas = sum(e.canvas_index == 0 for e in events if isinstance(e, CanvasRoundEvent))
    # polled before each step and before each canvas's encoder pass: cancelled before the
    # last canvas's last step, then at the first canvas boundary (before its encoder pass)
    for polls_allowed, forwards, canvases in (
        (full.num_forwards - 1 + full.blocks - 1, full.num_forwards - 1, full.blocks - 1),
        (first_canvas, first_canvas, 1),
    ):
        polls = iter(range(100))
        out, _ = run(CanvasDecoder(model, CPU, "eager"), cfg,
                     cancel=lambda polls=polls, n=polls_allowed: next(polls) >= n)
        assert out.finish_reason == "cancelled" and out.num_forwards == forwards
        assert out.blocks == canvases
        assert list(out.answer_ids) == list(full.answer_ids[: canvases * CANVAS])
    assert out.total_forwards == first_canvas + 1  # the prompt's pass; no canvas encoded


def test_bad_prompts_are_named(pair):
    _, model = pair
    decoder = CanvasDecoder(model, CPU, "eager", max_context=30)
    with pytest.raises(ConfigError, match="prompt: expected at least one token"):
        run(decoder, CanvasDecodeConfig(SETTINGS), prompt=[])
    too_long = r"prompt \(13 tokens\) \+ .*\(24\) = 37 tokens exceeds the model's context of 30"
    with pytest.raises(ConfigError, match=too_long):
        run(decoder, CanvasDecodeConfig(SETTINGS))


def test_eager_cache_capacity_is_named(pair):
    _, model = pair
    stepper = CanvasDecoder(model, CPU, "eager").stepper(True)
    stepper.reset(SETTINGS, 30)
    stepper.encode(torch.arange(20), 0)
    with pytest.raises(ConfigError, match="KV cache capacity exceeded: 31 positions > "
                                          r"max_tokens=30 \(reset\(\) with room"):
        stepper.encode(torch.arange(11), 20)
