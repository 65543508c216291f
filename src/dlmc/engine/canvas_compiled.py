"""The canvas stepper of modes "compile" and "graph": DiffusionGemma's passes run by the compiled
canvas runner (`dlmc.graphs.canvas_runner.CanvasRunner`: Inductor-compiled steps and encoder
chunks, replayed as CUDA graphs in "graph" mode).

Randomness. A compiled step draws from the default generator of the device (the opaque op
`dlmc::canvas_step_noise`, the same aten draws as an eager step, in transformers' order). The
decoder owns a generator seeded by the request; `drawing_from` swaps its state into the default
generator for the duration of each step and takes the advanced state back, then puts the
default generator's own state back. So a seeded request draws the same stream in every mode,
and the caller's default generator is left as it was (also between the decoder's yields).

The runner's static cache is sized to a power of two, at least `MIN_CACHE_TOKENS`, and grown
(with a new runner: new shapes, new compilations and captures) only when a request needs more;
a request with other sampler settings also gets a new runner (the settings are constants of
the compiled step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_rules import CanvasState, CanvasStep
from dlmc.graphs.canvas_runner import CanvasRunner
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

__all__ = ["CompiledCanvasStepper", "MIN_CACHE_TOKENS", "default_generator", "drawing_from"]

COMPILED_MODES = ("compile", "graph")
MIN_CACHE_TOKENS = 1024  # one cache (and one set of compiled steps) for every short request


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that draws with `generator=None` on `device` (CPU or CUDA)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ConfigError(f"device {str(device)!r}: the compiled canvas rounds run on CPU or CUDA")


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """Inside the block, the default generator of `generator`'s device draws `generator`'s
    stream; afterwards `generator` holds the advanced state and the default generator its own
    state again. Host-side only (a CUDA generator's state is its seed and offset)."""
    default = default_generator(generator.device)
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(saved)


class CompiledCanvasStepper:
    """A `CanvasStepper` over a `CanvasRunner` in `mode` "compile" or "graph" (CUDA only).
    Decodes over the KV cache only (`use_cache=False`, the whole-sequence recompute, is the
    eager modes')."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 use_cache: bool = True, kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None, mode: str = "compile") -> None:
        if mode not in COMPILED_MODES:
            raise ConfigError(f"compiled canvas mode {mode!r}: expected one of "
                              f"{', '.join(COMPILED_MODES)}")
        if mode == "graph" and device.type != "cuda":
            raise ConfigError(f"mode 'graph' (CUDA graphs) needs a CUDA device, got device "
                              f"{str(device)!r}; use mode 'compile' or 'eager'")
        if not use_cache:
            raise ConfigError(f"mode {mode!r} decodes over the KV cache only; use_cache=False "
                              "(a whole-sequence recompute) runs in modes 'eager' and "
                              "'reference'")
        self.model, self.device, self.mode, self.kernels = model, device, mode, kernels
        self.fp8_scales = fp8_scales  # an FP8 cache with these per-layer scales, else None
        self.dtype = model.lm_head_weight.dtype
        self.runner: CanvasRunner | None = None

    def _runner(self) -> CanvasRunner:
        if self.runner is None:
            raise RuntimeError("a compiled canvas stepper is used before reset()")
        return self.runner

    def reset(self, settings: CanvasSettings, capacity: int) -> None:
        runner = self.runner
        cache = None if runner is None else runner.cache
        if cache is None or cache.max_tokens < capacity:
            size = max(MIN_CACHE_TOKENS, 1 << max(capacity - 1, 0).bit_length())
            self.runner = runner = None  # free the old buffers and graphs first
            with torch.inference_mode(False):  # written in place by every pass
                cache = GemmaStaticCache(self.model.config, size, self.dtype, self.device,
                                         fp8_scales=self.fp8_scales)
        if runner is None or runner.settings != settings:
            with torch.inference_mode(False):
                self.runner = runner = CanvasRunner(self.model, cache, settings, self.mode,
                                                    self.kernels)
        runner.reset()

    def encode(self, token_ids: torch.Tensor, start: int) -> None:
        runner = self._runner()
        if start != runner.length:
            raise RuntimeError(f"encode at position {start}: the runner's cache ends at "
                               f"{runner.length} (passes must follow one another)")
        runner.encode(token_ids)

    def begin_canvas(self, canvas: torch.Tensor, start: int) -> None:
        runner = self._runner()
        if start != runner.length:
            raise RuntimeError(f"a canvas at position {start}: the runner's cache ends at "
                               f"{runner.length} (a canvas follows the cache)")
        runner.start_canvas(canvas[0], draw=False)  # the decoder drew it from its generator

    def step(self, steps_remaining: int, generator: torch.Generator) -> CanvasStep:
        """The runner's step (one launch: eager, compiled or a graph replay) drawing from
        `generator`. Its `tempered` is the runner's self-conditioning buffer: the step's
        tempered logits in the model's dtype."""
        runner = self._runner()
        expected = runner.settings.max_denoising_steps - runner.steps
        if steps_remaining != expected:
            raise RuntimeError(f"step n={steps_remaining}: the runner's canvas is at n="
                               f"{expected} (steps run from max_denoising_steps down to 1)")
        with drawing_from(generator):
            runner.launch()
        buf = runner.canvas
        state = CanvasState(buf.tokens[None], buf.argmax[None], buf.history[:, None],
                            buf.stopped[None])  # rows: one
        return CanvasStep(state, buf.sc_logits[None], buf.entropy[None], buf.accepted[None])
