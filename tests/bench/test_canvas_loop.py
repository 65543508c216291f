"""`canvas_loop_overhead` (the whole-decode part of `dlmc bench round --shape
diffusiongemma-26b-a4b`) on the CPU with a tiny random DiffusionGemma in eager mode: the decode
runs exactly the pinned canvases and steps, its passes are timed one by one, and the reported
figures agree with one another."""

from __future__ import annotations

import re

import pytest
import torch

from dlmc.bench import canvas_loop
from dlmc.bench.canvas_bench import CanvasBenchConfig, use_uniform_routing
from dlmc.bench.canvas_loop import (
    canvas_loop_overhead,
    loop_line,
    max_pass_tokens,
    pinned_settings,
)
from dlmc.engine.canvas_config import CanvasDecodeConfig
from dlmc.engine.canvas_decoder import CanvasDecoder
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_settings import CanvasSettings
from tests.models.gemma_tiny import CANVAS, tiny_model

PREFIX, CANVASES, STEPS = 20, 2, 4


@pytest.fixture(scope="module")
def model():
    net = tiny_model(4)
    use_uniform_routing(net, max_tokens=max_pass_tokens(CANVAS), seed=0)
    return net


def test_the_loop_runs_the_pinned_decode_and_reports_consistent_figures(model):
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX)
    got = canvas_loop_overhead(model, bench, mode="eager", canvases=CANVASES, steps=STEPS,
                               repeats=2)
    assert (got["mode"], got["canvases"], got["steps_per_canvas"]) == ("eager", CANVASES, STEPS)
    assert got["steps"] == CANVASES * STEPS == 8
    assert got["tokens"] == CANVASES * CANVAS  # no EOS rule: every canvas appended whole
    # the prompt in one encoder pass, then the first canvas (the last one is never encoded)
    assert got["encoder_passes"] == len(got["encode_ms"]) == 2
    assert all(ms > 0 for ms in got["encode_ms"]) and got["step_ms_median"] > 0
    assert got["forwards_ms"] == pytest.approx(sum(got["encode_ms"]) + got["steps_ms"])
    assert len(got["wall_ms_runs"]) == 2 and got["wall_ms"] >= 0
    assert got["wall_minus_forwards_ms"] == pytest.approx(got["wall_ms"] - got["forwards_ms"])
    assert got["host_overhead_ms"] == pytest.approx(max(got["wall_minus_forwards_ms"], 0.0))
    assert got["fraction"] == pytest.approx(got["host_overhead_ms"] / got["wall_ms"])
    assert 0 <= got["fraction"] < 1


def test_the_pinned_settings_never_stop_a_canvas_early(model):
    """The decoder itself, on the pinned settings: every canvas runs all its steps. The same
    decode with a stopping test every step passes (stability over no earlier canvas, a
    confidence bound every entropy meets) stops each canvas at its first step."""
    decoder = CanvasDecoder(model, torch.device("cpu"), "eager")
    prompt = list(range(3, 3 + PREFIX))
    pinned = pinned_settings(CANVAS, STEPS, CANVASES)
    out = _decode(decoder, prompt, pinned)
    assert (out.blocks, out.num_forwards, len(out.answer_ids)) == (2, 8, 2 * CANVAS)
    loose = CanvasSettings(canvas_length=CANVAS, max_denoising_steps=STEPS, eos_token_ids=(),
                           stability_threshold=0, confidence_threshold=1e9,
                           max_new_tokens=CANVASES * CANVAS)
    assert _decode(decoder, prompt, loose).num_forwards == CANVASES


def test_a_decode_that_stops_early_is_an_error(model, monkeypatch):
    """The loop checks the step count the decode ran against the pinned one."""
    def stopping(canvas: int, steps: int, canvases: int) -> CanvasSettings:
        return CanvasSettings(canvas_length=canvas, max_denoising_steps=steps, eos_token_ids=(),
                              stability_threshold=0, confidence_threshold=1e9,
                              max_new_tokens=canvases * canvas)

    monkeypatch.setattr(canvas_loop, "pinned_settings", stopping)
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX)
    with pytest.raises(RuntimeError, match="ran 2 steps in 2 canvases; pinned: 2 x 4"):
        canvas_loop_overhead(model, bench, mode="eager", canvases=CANVASES, steps=STEPS,
                             repeats=1)


def test_bad_loop_arguments_name_the_option(model):
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX)
    with pytest.raises(ConfigError, match="steps must be an integer >= 1"):
        pinned_settings(CANVAS, 0, CANVASES)
    with pytest.raises(ConfigError, match="repeats must be an integer >= 1"):
        canvas_loop_overhead(model, bench, mode="eager", repeats=0)
    with pytest.raises(ConfigError, match="mode 'graph'"):  # CUDA graphs need a GPU
        canvas_loop_overhead(model, bench, mode="graph")


def test_uniform_routing_refuses_a_forward_longer_than_its_routes():
    net = tiny_model(5)
    use_uniform_routing(net, max_tokens=4, seed=0)
    router = net.model.decoder.layers[0].router
    with pytest.raises(ConfigError, match="max_tokens"):
        router(torch.zeros(5, net.config.hidden_size))
    assert max_pass_tokens(256) == 1024 and max_pass_tokens(2048) == 2048


def test_the_printed_line_holds_what_perf_gpu_sh_greps():
    loop = {"mode": "graph", "host_overhead_ms": 12.34, "wall_ms": 512.0, "fraction": 0.0241,
            "forwards_ms": 499.66, "canvases": 2, "steps_per_canvas": 16,
            "step_ms_median": 14.5, "encoder_passes": 2, "encode_ms": [20.0, 15.5]}
    line = loop_line(loop)
    assert re.search(r"host overhead: 12\.3 ms of 512\.0 ms \(2\.4 %\)", line)
    assert "2 canvases x 16 steps" in line and "2 encoder passes (35.5 ms)" in line


def _decode(decoder: CanvasDecoder, prompt: list[int], settings: CanvasSettings):
    events = decoder.decode(prompt, CanvasDecodeConfig(settings, seed=0))
    while True:
        try:
            next(events)
        except StopIteration as stop:
            return stop.value
