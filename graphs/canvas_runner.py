"""DiffusionGemma's capture site: runs `canvas_round` / `encode_chunk` eager, compiled
(`dlmc.graphs.compile`) or as CUDA graphs captured per key-length bucket.

The decoder's whole loop over one canvas is:

    runner.encode(prompt_ids)           # causal pass, fills the cache (chunked, padded)
    runner.start_canvas()               # draws the uniform-random canvas, resets the state
    while not runner.step():            # one denoising step; the host reads one flag
        ...                             # (live view: runner.canvas.tokens / .accepted)
    appended = runner.canvas.argmax     # the argmax canvas; EOS rules are the caller's
    runner.encode(appended)             # unless it is the last canvas

Randomness: the initial canvas (`start_canvas`) and every step's draws come from the default
generator of the cache's device (seed it with `torch.manual_seed`), in transformers' order, in
every mode: a captured step replays the same aten draws, which advance the generator as an
eager step does. Capturing a graph runs the step twice to warm up; the buffers and the
generator state are put back afterwards, so capture changes nothing the caller sees.

Buckets: the full layers attend a power-of-two number of cache slots (at least `min_bucket`,
by default 256; at most the cache size) at or above the cache length; each (first step or not,
bucket) step and each (chunk size, bucket) encoder pass is compiled and captured once. Encoder
chunks are padded to a power of two (at least 16, at most `max_chunk` tokens) so that few chunk
sizes occur; the padding's K/V lie past the cache length, never attended, overwritten next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_round import CanvasBuffers, canvas_round, encode_chunk
from dlmc.graphs.canvas_rules import draw_initial_canvas
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.graphs.compile import compiled
from dlmc.graphs.runner import capture_graph
from dlmc.kv.gemma_static_cache import GemmaStaticCache

log = logging.getLogger(__name__)
MODES = ("eager", "compile", "graph")
MIN_BUCKET = 256
MIN_CHUNK = 16


class CanvasRunner:
    """Static canvas buffers + compiled/captured steps and encoder chunks for one model and
    cache. `mode`: eager, compile or graph (CUDA); `kernels` sets the compile site's options.

    Attributes: `canvas` (`CanvasBuffers`: tokens, argmax, accepted, stopped, done, ...),
    `length` (positions encoded in the cache, on the host), `steps` (denoising steps run on
    the current canvas: the decoder forwards that TPF counts), `compile_s` (time in first
    calls: compile, autotune, capture).
    """

    def __init__(self, model: torch.nn.Module, cache: GemmaStaticCache, settings: CanvasSettings,
                 mode: str, kernels: KernelConfig = DEFAULT_KERNELS, max_chunk: int = 512,
                 min_bucket: int = MIN_BUCKET) -> None:
        if mode not in MODES:
            raise ConfigError(f"canvas round mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "graph" and cache.device.type != "cuda":
            raise ConfigError("canvas round mode 'graph' needs a CUDA device (use 'compile' or "
                              "'eager')")
        for name, value in (("max_chunk", max_chunk), ("min_bucket", min_bucket)):
            if value < 1 or value & (value - 1):
                raise ConfigError(f"CanvasRunner {name} must be a power of two, got {value}")
        self.model, self.cache, self.settings, self.mode = model, cache, settings, mode
        self.kernels, self.max_chunk, self.min_bucket = kernels, max_chunk, min_bucket
        self.vocab_size = model.config.vocab_size
        with torch.inference_mode(False):  # static buffers are normal tensors
            self.canvas = CanvasBuffers.allocate(settings, self.vocab_size,
                                                 model.lm_head_weight.dtype, cache.device)
        self.length = int(cache.length)
        self.steps = 0
        self._first = True
        self._encode_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple[Any, ...], torch.cuda.CUDAGraph | None] = {}
        self._pool: Any = None
        self.compile_s = 0.0

    @property
    def _triton(self) -> bool:
        """Attention through `dlmc::paged_attention` (`KernelConfig.gemma_attention`)."""
        kind = self.kernels.gemma_attention
        return kind == "triton" or (kind == "auto" and self.cache.device.type == "cuda"
                                    and self.cache.dtype == torch.bfloat16)

    @property
    def _triton_sampler(self) -> bool:
        """The proposal from `dlmc::canvas_propose` (`KernelConfig.gemma_sampler`)."""
        return self.kernels.triton_gemma_sampler(self.cache.device.type)

    def key_len(self, end: int) -> int:
        """Cache slots the full layers attend when `end` positions must be visible: the
        power-of-two bucket at or above `end` (at least `min_bucket`, at most the cache size);
        the cache size whatever `end` with `dlmc::paged_attention` (which reads the length on
        the device only: one compiled step and encoder chunk per size for every length)."""
        if self._triton:
            return self.cache.max_tokens
        bucket = self.min_bucket
        while bucket < end:
            bucket *= 2
        return min(bucket, self.cache.max_tokens)

    # -- the encoder -------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache (a new sequence)."""
        self.cache.reset()
        self.length = 0

    def encode(self, tokens: torch.Tensor) -> None:
        """The encoder pass of `tokens [n]` (int64, any device) at the positions right after the
        cache, in chunks of at most `max_chunk` tokens; the cache length grows by n."""
        tokens = tokens.reshape(-1)
        if self.length + tokens.numel() > self.cache.max_tokens:
            raise ConfigError(f"KV cache capacity exceeded: {self.length} + {tokens.numel()} "
                              f"tokens > max_tokens={self.cache.max_tokens} (raise the engine's "
                              "max context or shorten the request)")
        for offset in range(0, tokens.numel(), self.max_chunk):
            self._encode(tokens[offset:offset + self.max_chunk])

    def _encode(self, tokens: torch.Tensor) -> None:
        n, start = tokens.numel(), self.length
        size = max(MIN_CHUNK, 1 << (n - 1).bit_length())
        if start + size > self.cache.max_tokens:  # no room for the padding: this size exactly
            size = n
        ids, positions, length = self._chunk_buffers(size)
        ids.zero_()
        ids[:n].copy_(tokens)
        positions.copy_(torch.arange(start, start + size))
        length.fill_(start + n)
        key_len = self.key_len(start + size)
        fn = encode_chunk if self.mode == "eager" else self._compiled("encode_chunk", encode_chunk)
        self._run(("encode", size, key_len), lambda: fn(self.model, ids, positions, self.cache,
                                                        key_len, length, self._triton))
        self.length = start + n

    def _chunk_buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static (ids [size], positions [size], length []) inputs of encoder chunks of `size`."""
        if size not in self._encode_inputs:
            device = self.cache.device
            with torch.inference_mode(False):
                self._encode_inputs[size] = (
                    torch.zeros(size, dtype=torch.int64, device=device),
                    torch.zeros(size, dtype=torch.int64, device=device),
                    torch.zeros((), dtype=torch.int64, device=device))
        return self._encode_inputs[size]

    # -- the denoising steps -----------------------------------------------------------------
    def start_canvas(self, canvas: torch.Tensor | None = None, draw: bool = True) -> None:
        """A new canvas after the cache: the uniform-random ids `[C]` are drawn from the default
        generator (also when `canvas [C]` is given and used instead, as transformers draws them
        with `decoder_input_ids`, unless `draw` is False: a caller that drew `canvas` itself),
        the step state reset, n = `max_denoising_steps`."""
        c = self.settings.canvas_length
        if canvas is not None and tuple(canvas.shape) != (c,):
            raise ConfigError(f"start_canvas: canvas must have shape ({c},), got "
                              f"{tuple(canvas.shape)}")
        if draw:
            drawn = draw_initial_canvas((1, c), self.vocab_size, None, self.cache.device)[0]
            canvas = drawn if canvas is None else canvas  # [C]
        elif canvas is None:
            raise ConfigError("start_canvas: draw=False needs the canvas")
        self.canvas.start(canvas, self.length, self.settings)
        self.steps = 0
        self._first = True

    def step(self, eager: bool = False) -> bool:
        """Run one denoising step; returns the device's "done" flag (stopped, or the step budget
        spent): the one host sync per step. `eager`: this step runs eagerly whatever the mode
        (nothing compiled or captured for it: a benchmark's canvas-opening step)."""
        self.launch(eager)
        return bool(self.canvas.done)

    def launch(self, eager: bool = False) -> None:
        """`step` without reading the flag: the step is only queued on the device."""
        key_len, first = self.key_len(self.length), self._first
        args = (self.model, self.canvas, self.cache, key_len, self.settings, first, self._triton,
                self._triton_sampler)
        if eager or self.mode == "eager":
            with torch.no_grad():
                canvas_round(*args)
        else:
            fn = self._compiled("canvas_round", canvas_round)
            self._run(("step", first, key_len), lambda: fn(*args))
        self._first = False
        self.steps += 1

    # -- compile and capture -----------------------------------------------------------------
    def _compiled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return compiled(name, fn, self.kernels, canvas=True)

    def _run(self, key: tuple[Any, ...], fn: Callable[[], None]) -> None:
        with torch.no_grad():
            if self.mode != "graph":
                first = key not in self._graphs
                started = time.perf_counter()
                fn()
                if first and self.mode == "compile":
                    self._graphs[key] = None
                    self.compile_s += time.perf_counter() - started
                return
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture(fn)
            graph.replay()

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm up (compile, autotune) and capture `fn`, leaving the canvas buffers and the
        default generator's state as they were (an encoder chunk rewrites the same K/V)."""
        started = time.perf_counter()
        saved = self.canvas.snapshot()
        rng = torch.cuda.get_rng_state(self.cache.device)
        graph, self._pool = capture_graph(fn, self._pool)
        self.canvas.restore(saved)
        torch.cuda.set_rng_state(rng, self.cache.device)
        torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - started
        log.info("captured a canvas graph in %.1f s", time.perf_counter() - started)
        return graph
