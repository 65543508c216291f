"""`dlmc bench round --shape diffusiongemma-26b-a4b --loop`: a whole canvas decode's host overhead.

The engine's canvas decoder (`dlmc.engine.canvas_decoder.CanvasDecoder`, graph mode on CUDA)
decodes a random prompt of `prefix` tokens into `canvases` canvases of exactly `steps` denoising
steps each (`pinned_settings`). A first decode warms up (compiles, captures the graphs); the
next ones are timed whole by the wall clock, synchronised before and after. The same passes are
then run again one at a time through the decoder's own stepper, each timed by itself with CUDA
events (wall clock on the CPU): every encoder pass, and every step together with the host's
read of its stop flag, as `time_steps` times a step. The sum of those times is the decode's
device work; what the wall time has beyond it is host overhead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch

from dlmc.bench.canvas_bench import CanvasBenchConfig
from dlmc.bench.timing import drain
from dlmc.engine.canvas_config import CanvasDecodeConfig
from dlmc.engine.canvas_decoder import PREFILL_CHUNK, CanvasDecoder
from dlmc.engine.events import DecodeOutput
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_rules import draw_initial_canvas
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

LOOP_CANVASES = 2
LOOP_STEPS = 16
T = TypeVar("T")


def max_pass_tokens(canvas: int) -> int:
    """The most tokens one forward of a decode takes: a canvas, or an encoder chunk (at most
    the decoder's `PREFILL_CHUNK`; the compiled modes split it further)."""
    return max(canvas, PREFILL_CHUNK)


def pinned_settings(canvas: int, steps: int, canvases: int) -> CanvasSettings:
    """Settings under which a decode appends exactly `canvases` canvases of exactly `steps`
    steps each: no EOS id ends the answer, and the stopping test's stability needs `steps`
    earlier argmax canvases, which a canvas never has within its `steps` steps (the history
    starts at -1), so no canvas stops early."""
    for name, value in (("canvas", canvas), ("steps", steps), ("canvases", canvases)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"canvas loop: {name} must be an integer >= 1, got {value!r}")
    return CanvasSettings(canvas_length=canvas, max_denoising_steps=steps,
                          stability_threshold=steps, eos_token_ids=(),
                          max_new_tokens=canvases * canvas)


def _timed(fn: Callable[[], T], cuda: bool) -> tuple[float, T]:
    """Milliseconds of `fn` by itself (CUDA events, ended by a sync; wall clock without CUDA)
    and its result."""
    if not cuda:
        started = time.perf_counter()
        out = fn()
        return (time.perf_counter() - started) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def _passes(decoder: CanvasDecoder, prompt: list[int], settings: CanvasSettings, seed: int
            ) -> tuple[list[float], list[float]]:
    """The decode's passes in its order (`CanvasDecoder.decode` with no early stop: the
    prompt's chunks; per canvas, after encoding the previous one, its steps), each timed by
    itself: (encoder pass ms, step ms)."""
    device, cuda = decoder.device, decoder.device.type == "cuda"
    stepper = decoder.stepper(True)
    c, canvases = settings.canvas_length, settings.canvas_count
    generator = torch.Generator(device=device).manual_seed(seed)
    encode_ms: list[float] = []
    step_ms: list[float] = []

    def step(n: int) -> Any:
        out = stepper.step(n, generator)
        bool(out.state.stopped.all())  # the decoder's one host read per step
        return out

    with torch.inference_mode():
        ids = torch.tensor(prompt, dtype=torch.long, device=device)  # [P]
        stepper.reset(settings, len(prompt) + (canvases - 1) * c)
        for offset in range(0, len(prompt), decoder.prefill_chunk):
            chunk = ids[offset: offset + decoder.prefill_chunk]
            encode_ms.append(_timed(partial(stepper.encode, chunk, offset), cuda)[0])
        appended: torch.Tensor | None = None
        for index in range(canvases):
            start = len(prompt) + index * c
            if appended is not None:
                encode_ms.append(_timed(partial(stepper.encode, appended, start - c), cuda)[0])
            drawn = draw_initial_canvas((1, c), decoder.model.config.vocab_size, generator,
                                        device)  # [1, C]
            stepper.begin_canvas(drawn, start)
            last = None
            for n in range(settings.max_denoising_steps, 0, -1):
                ms, last = _timed(partial(step, n), cuda)
                step_ms.append(ms)
            appended = last.state.argmax[0].clone()  # [C] (no EOS rule: the whole argmax)
    return encode_ms, step_ms


def canvas_loop_overhead(model: DiffusionGemmaForBlockDiffusion, bench: CanvasBenchConfig,
                         mode: str = "graph", canvases: int = LOOP_CANVASES,
                         steps: int = LOOP_STEPS, repeats: int = 3,
                         fp8_scales: KVScales | None = None) -> dict[str, Any]:
    """Wall time of a whole decode in `mode` (median of `repeats` timed decodes after one
    warm-up) against the sum of its passes timed one by one (per pass, the median of `repeats`
    runs). `host_overhead_ms` is the difference (a negative one, timing noise, counts as 0;
    the signed value is `wall_minus_forwards_ms`); `fraction` is it over the wall time. With
    `fp8_scales` the decoder's cache is FP8 with those per-layer K/V scales."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"canvas loop: repeats must be an integer >= 1, got {repeats!r}")
    settings = pinned_settings(bench.canvas, steps, canvases)
    device = model.lm_head_weight.device
    decoder = CanvasDecoder(model, device, mode, kernels=bench.kernels, fp8_scales=fp8_scales)
    cfg = CanvasDecodeConfig(settings, seed=bench.seed)
    gen = torch.Generator().manual_seed(bench.seed)
    prompt = torch.randint(0, model.config.vocab_size, (bench.prefix,), generator=gen).tolist()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def decode() -> tuple[float, DecodeOutput]:
        sync()
        started = time.perf_counter()
        out = drain(decoder.decode(prompt, cfg))
        sync()
        return (time.perf_counter() - started) * 1e3, out

    warmup_ms, _ = decode()  # compiles and captures every pass of the decode
    walls: list[float] = []
    for _ in range(repeats):
        wall, out = decode()
        walls.append(wall)
        if out.blocks != canvases or out.num_forwards != canvases * steps:
            raise RuntimeError(f"canvas loop: the decode ran {out.num_forwards} steps in "
                               f"{out.blocks} canvases; pinned: {canvases} x {steps}")
    runs = [_passes(decoder, prompt, settings, bench.seed) for _ in range(repeats)]
    encode_ms = [statistics.median(r[0][i] for r in runs) for i in range(len(runs[0][0]))]
    step_ms = [statistics.median(r[1][i] for r in runs) for i in range(len(runs[0][1]))]
    if len(encode_ms) != out.total_forwards - out.num_forwards or len(step_ms) != steps * canvases:
        raise RuntimeError(f"canvas loop: timed {len(encode_ms)} encoder passes and "
                           f"{len(step_ms)} steps; the decode ran "
                           f"{out.total_forwards - out.num_forwards} and {out.num_forwards}")
    wall_ms = statistics.median(walls)
    forwards_ms = sum(encode_ms) + sum(step_ms)
    overhead_ms = max(wall_ms - forwards_ms, 0.0)
    return {"mode": mode, "prefix": bench.prefix, "canvas": bench.canvas,
            "canvases": out.blocks, "steps_per_canvas": steps, "steps": out.num_forwards,
            "tokens": len(out.answer_ids), "encoder_passes": len(encode_ms),
            "encoder_pass_tokens": decoder.prefill_chunk, "repeats": repeats,
            "warmup_ms": warmup_ms, "wall_ms": wall_ms, "wall_ms_runs": walls,
            "step_ms_median": statistics.median(step_ms), "steps_ms": sum(step_ms),
            "encode_ms": encode_ms, "forwards_ms": forwards_ms,
            "wall_minus_forwards_ms": wall_ms - forwards_ms, "host_overhead_ms": overhead_ms,
            "fraction": overhead_ms / wall_ms}


def loop_line(loop: dict[str, Any]) -> str:
    """One line of the loop's figures, `host overhead: X ms of Y ms (Z %)` first."""
    return (f"canvas loop ({loop['mode']}): host overhead: {loop['host_overhead_ms']:.1f} ms of "
            f"{loop['wall_ms']:.1f} ms ({100 * loop['fraction']:.1f} %); forwards "
            f"{loop['forwards_ms']:.1f} ms = {loop['canvases']} canvases x "
            f"{loop['steps_per_canvas']} steps ({loop['step_ms_median']:.3f} ms median) + "
            f"{loop['encoder_passes']} encoder passes ({sum(loop['encode_ms']):.1f} ms)")
