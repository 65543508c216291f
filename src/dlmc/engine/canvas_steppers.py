"""How DiffusionGemma's encoder and decoder passes run: one `CanvasStepper` per `mode`.

The canvas decoder (`dlmc.engine.canvas_decoder`) owns the loop (canvases, steps, EOS,
events) and the random generator; a stepper owns the KV cache, the canvas state and the
self-conditioning logits between steps. Per request: `reset`, then `encode` the prompt's
chunks; per canvas: `begin_canvas` with its initial ids, then `step` until the decoder reads a
stop, then `encode` the appended canvas before the next. Steppers are registered in `STEPPERS`
by mode.

- "reference": the model's own reference cache and contexts (`GemmaKVCache`, `CausalContext`,
  `CanvasContext`), and the step as transformers writes it (`canvas_step_reference`:
  `torch.multinomial`, `Categorical`, `torch.randint`).
- "eager": the compiled rounds' static cache and contexts (`dlmc.kv.gemma_static_cache`,
  `dlmc.kv.gemma_round_attention`) at the exact cache length, and the sync-free step a
  compiled round runs (`canvas_step` on noise drawn by `draw_step_noise`).
With `fp8_scales` the static cache holds FP8 K/V ("eager", "compile", "graph"); "reference"
refuses it.
- "compile", "graph": the compiled canvas runner (`dlmc.engine.canvas_compiled`): each step
  one Inductor-compiled function over key-length buckets and padded encoder chunks, replayed
  as a CUDA graph in "graph" mode (CUDA only).
Every mode draws the decoder's generator in transformers' order (the compiled ones through the
device's default generator, into which the decoder's state is swapped for each step). With
`use_cache=False` the eager modes rebuild the cache from every clean token before each step (a
whole-sequence recompute, for tests); the compiled modes refuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.engine.canvas_compiled import CompiledCanvasStepper
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_rules import (
    CanvasState,
    CanvasStep,
    canvas_step,
    canvas_step_reference,
    draw_step_noise,
    initial_state,
    self_conditioning_input,
)
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_round_attention import CanvasRoundAttention, EncodeRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion, GemmaAttentionContext
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache


class CanvasStepper(Protocol):
    """One request's passes (rows: one; canvas length C; vocabulary V)."""

    def reset(self, settings: CanvasSettings, capacity: int) -> None:
        """A new request decoded with `settings`: an empty cache with room for `capacity`
        encoded positions."""
        ...

    def encode(self, token_ids: torch.Tensor, start: int) -> None:
        """Encoder pass over clean `token_ids [T]` at positions `start .. start + T - 1` (right
        after the cache): causal, K/V written to the cache."""
        ...

    def begin_canvas(self, canvas: torch.Tensor, start: int) -> None:
        """A new canvas `[1, C]` int64 at positions `start .. start + C - 1` (right after the
        cache): its state before the first step, no self-conditioning."""
        ...

    def step(self, steps_remaining: int, generator: torch.Generator) -> CanvasStep:
        """One denoising step at n = `steps_remaining`: decoder forward over [cache ; canvas],
        temper, sample, accept, re-noise, stopping test, next self-conditioning input; draws
        from `generator`. The returned tensors stay valid until the next call (`tempered` is
        in the model's dtype in the compiled modes: their self-conditioning buffer)."""
        ...


class _EagerStepper:
    """What the eager strategies share: the canvas state and the self-conditioning logits, the
    decoder forward, and the whole-sequence recompute of `use_cache=False`."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 use_cache: bool = True, kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None) -> None:
        self.model, self.device, self.use_cache = model, device, use_cache  # kernels: unused
        self.fp8_scales = fp8_scales
        self.vocab_size = model.config.vocab_size
        self.sc_dtype = model.model.decoder.embed_tokens.weight.dtype
        self.settings = CanvasSettings()
        self._clean: list[torch.Tensor] = []  # every encoded token (use_cache=False)
        self._state: CanvasState | None = None
        self._sc: torch.Tensor | None = None  # [1, C, V] the next step's sc logits
        self._start = 0

    def reset(self, settings: CanvasSettings, capacity: int) -> None:
        self.settings = settings
        self._clean = []
        self._clear_cache(capacity)

    def encode(self, token_ids: torch.Tensor, start: int) -> None:
        if self.use_cache:
            self._encode(token_ids, start)
        else:
            self._clean.append(token_ids)

    def begin_canvas(self, canvas: torch.Tensor, start: int) -> None:
        self._state = initial_state(canvas, self.settings)
        self._sc, self._start = None, start

    def step(self, steps_remaining: int, generator: torch.Generator) -> CanvasStep:
        if self._state is None:
            raise RuntimeError("step() before begin_canvas()")
        if not self.use_cache:  # recompute the cache from every clean token
            self._clear_cache(self._start)
            if self._clean:
                self._encode(torch.cat(self._clean), 0)
        state, length = self._state, self.settings.canvas_length
        positions = torch.arange(self._start, self._start + length, device=self.device)  # [C]
        sc = None if self._sc is None else self._sc[0]  # [C, V]
        logits = self.model(state.canvas[0], positions, self._canvas_context(), decoder=True,
                            self_conditioning_logits=sc)  # [C, V] fp32
        step = self._rule(logits[None], state, steps_remaining, generator)
        self._sc = self_conditioning_input(step.tempered, self._sc, state.stopped, self.sc_dtype)
        self._state = step.state
        return step

    def _clear_cache(self, capacity: int) -> None:
        raise NotImplementedError

    def _encode(self, token_ids: torch.Tensor, start: int) -> None:
        raise NotImplementedError

    def _canvas_context(self) -> GemmaAttentionContext:
        raise NotImplementedError

    def _rule(self, logits: torch.Tensor, state: CanvasState, steps_remaining: int,
              generator: torch.Generator) -> CanvasStep:
        raise NotImplementedError


class ReferenceCanvasStepper(_EagerStepper):
    """The model's reference cache and contexts, transformers' sampling calls."""

    cache: GemmaKVCache

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 use_cache: bool = True, kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None) -> None:
        if fp8_scales is not None:
            raise ConfigError("kv_cache_dtype 'fp8': mode 'reference' keeps K/V in the "
                              "activation dtype; use mode 'eager' (--mode eager) or "
                              "kv_cache_dtype 'bf16'")
        super().__init__(model, device, use_cache, kernels)

    def _clear_cache(self, capacity: int) -> None:
        self.cache = GemmaKVCache(self.model.config.num_hidden_layers)

    def _encode(self, token_ids: torch.Tensor, start: int) -> None:
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)  # [T]
        self.model(token_ids, positions, CausalContext(self.cache), compute_logits=False)

    def _canvas_context(self) -> GemmaAttentionContext:
        return CanvasContext(self.cache)

    def _rule(self, logits: torch.Tensor, state: CanvasState, steps_remaining: int,
              generator: torch.Generator) -> CanvasStep:
        return canvas_step_reference(logits, state, steps_remaining, generator, self.settings)


class EagerCanvasStepper(_EagerStepper):
    """The compiled rounds' cache (`GemmaStaticCache`) and contexts, called at the exact cache
    length (no key-length bucket, no padded chunk): each pass attends to the keys that
    transformers' cache holds, in the same order under the same mask, so it computes
    transformers' logits bit for bit. The sync-free step, its noise drawn in transformers' order.
    """

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 use_cache: bool = True, kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None) -> None:
        super().__init__(model, device, use_cache, kernels, fp8_scales)
        self.cache = self._allocate(1)  # grown by reset() to each request's size
        self._length = 0  # the cache's length on the host (no device read per pass)

    def _allocate(self, capacity: int) -> GemmaStaticCache:
        with torch.inference_mode(False):  # written in place by every later pass
            return GemmaStaticCache(self.model.config, capacity, self.sc_dtype, self.device,
                                    fp8_scales=self.fp8_scales)

    def _clear_cache(self, capacity: int) -> None:
        if self.cache.max_tokens < capacity:
            self.cache = self._allocate(capacity)
        self.cache.reset()
        self._length = 0

    def _encode(self, token_ids: torch.Tensor, start: int) -> None:
        end = start + token_ids.shape[0]
        if end > self.cache.max_tokens:
            raise ConfigError(f"KV cache capacity exceeded: {end} positions > max_tokens="
                              f"{self.cache.max_tokens} (reset() with room for the request)")
        positions = torch.arange(start, end, device=self.device)  # [T]
        self.model(token_ids, positions, EncodeRoundAttention(self.cache, positions, end),
                   compute_logits=False)
        self.cache.length.fill_(end)
        self._length = end

    def _canvas_context(self) -> GemmaAttentionContext:
        return CanvasRoundAttention(self.cache, self._length)

    def _rule(self, logits: torch.Tensor, state: CanvasState, steps_remaining: int,
              generator: torch.Generator) -> CanvasStep:
        shape = tuple(state.canvas.shape)
        noise = draw_step_noise(shape, self.vocab_size, generator, self.device)
        return canvas_step(logits, state, steps_remaining, noise, self.settings)


# (model, device, use_cache, kernels, fp8_scales) -> a stepper; a strategy without uncached
# decoding raises ConfigError for use_cache=False, one that needs CUDA on another device, one
# without an FP8 cache for fp8_scales
StepperFactory = Callable[[DiffusionGemmaForBlockDiffusion, torch.device, bool, KernelConfig,
                           KVScales | None], CanvasStepper]
STEPPERS: dict[str, StepperFactory] = {
    "graph": partial(CompiledCanvasStepper, mode="graph"),
    "compile": partial(CompiledCanvasStepper, mode="compile"),
    "eager": EagerCanvasStepper,
    "reference": ReferenceCanvasStepper,
}
MODES = tuple(STEPPERS)


def default_canvas_mode(device: torch.device) -> str:
    """"graph" on CUDA, else "eager"."""
    return "graph" if device.type == "cuda" else "eager"


def check_canvas_mode(mode: str) -> None:
    """A mode DiffusionGemma runs, or an error that names them."""
    if mode not in STEPPERS:
        raise ConfigError(f"mode {mode!r}: expected one of {', '.join(MODES)}")


def make_stepper(mode: str, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 use_cache: bool = True, kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None) -> CanvasStepper:
    """The stepper of `mode` (see `check_canvas_mode`) with `kernels`' choices; its cache holds
    FP8 K/V with these per-layer scales when `fp8_scales` is given."""
    check_canvas_mode(mode)
    return STEPPERS[mode](model, device, use_cache, kernels, fp8_scales)
