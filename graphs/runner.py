"""The one capture site: runs `denoise_round` / `fill_kv` eager, compiled
(`dlmc.graphs.compile`) or as CUDA graphs captured per key-length bucket.

A sampled round at a temperature alone draws its Exp(1) noise eagerly with the request's
generator (`torch.multinomial`'s own draw) and replays the whole round on it
(`NoiseSampling`); with top-k or top-p it compiles and captures only its forward
(`round_logits`, into a static logits buffer) and takes the seeded decision eagerly on it.

Buckets: the key length (cache slots a round may attend to) is rounded up to a power of two
(at least 256, at most the cache size); each (algorithm, bucket) is compiled and captured once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs.compile import compiled
from dlmc.graphs.in_flight import FlagReads
from dlmc.graphs.round import (
    NoiseSampling,
    RoundBuffers,
    decide,
    denoise_round,
    denoise_round_fused,
    fill_kv,
    round_logits,
    round_logits_fused,
)
from dlmc.kv.dense_cache import DenseKVCache
from dlmc.kv.paged_cache import PagedKVCache

log = logging.getLogger(__name__)
MODES = ("eager", "compile", "graph")
MIN_BUCKET = 256
MAX_STEPS = 4096

def capture_graph(fn: Callable[[], None], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """The capture site: `fn` run twice on a side stream (compile, autotune, allocate), then
    captured as a CUDA graph in the memory `pool` (a new one when None); returns the graph and
    the pool. `fn` ran three times: the caller restores any state it changed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph, pool


class RoundRunner:
    """Static buffers + compiled/captured rounds for one model and block length; `kernels`
    sets the compile site's options (`dlmc.graphs.compile`)."""

    def __init__(
        self, model: torch.nn.Module, cache: DenseKVCache | PagedKVCache, block_length: int,
        mask_id: int, mode: str, kernels: KernelConfig = DEFAULT_KERNELS,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"round mode {mode!r}: expected one of {', '.join(MODES)}")
        device = cache.device
        self.max_tokens = getattr(cache, "max_tokens", None) or cache.capacity
        if mode == "graph" and device.type != "cuda":
            raise ConfigError("round mode 'graph' needs a CUDA device (use 'compile' or 'eager')")
        self.model, self.cache, self.bl, self.mask_id, self.mode = (
            model, cache, block_length, mask_id, mode)
        self.kernels = kernels
        self.buf = RoundBuffers.allocate(block_length, MAX_STEPS, device)
        # The finished block whose refresh a fused round carries (`step_fused`).
        self.prev_tokens = torch.zeros(block_length, dtype=torch.long, device=device)
        self.prev_positions = torch.zeros(block_length, dtype=torch.long, device=device)
        # [bl, V] fp32 logits of a sampled round's captured forward (allocated by the first).
        self.logits: torch.Tensor | None = None
        # A temperature-only sampled round's inputs (`NoiseSampling`, allocated by the first).
        self.noise: NoiseSampling | None = None
        self._graphs: dict[tuple[Any, ...], torch.cuda.CUDAGraph] = {}
        # The host's reads of each round's (done, masks_left) with rounds in flight.
        self.flag_reads = FlagReads(self.buf.done, self.buf.masks_left)
        self._fill_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        self.compile_s = 0.0  # time spent in first calls (compile / autotune / capture)

    def key_len(self, end: int) -> int:
        """Key slots a round ending at `end` attends: the dense cache's power-of-two bucket; the
        paged cache reads its live length on the device, so one value (one compiled round, one
        graph) serves every prefix length."""
        if isinstance(self.cache, PagedKVCache):
            return self.max_tokens
        bucket = MIN_BUCKET
        while bucket < end:
            bucket *= 2
        return min(bucket, self.max_tokens)

    # -- denoising rounds ------------------------------------------------------------------
    def step(self, algorithm: str, key_len: int, sampling: Any = None) -> bool:
        """Run one round of the block in `self.buf`; returns the device's "done" flag.

        `sampling` (temperature, top_k, top_p, generator): see the module docstring."""
        self.launch(algorithm, key_len, sampling)
        return bool(self.buf.done)  # the one host sync per round

    def launch(self, algorithm: str, key_len: int, sampling: Any = None) -> None:
        """`step` without reading the "done" flag: the round is only queued on the device."""
        whole = self._whole_round_sampling(sampling)
        if whole is False:  # top-k / top-p, compiled: the forward captured, the decision eager
            logits = self._logits_buffer()
            fn = self._compiled("round_logits", round_logits)
            self._run(("logits", key_len), lambda: fn(self.model, self.buf, logits, self.cache,
                                                      key_len, self.bl))
            decide(logits, self.buf, self.mask_id, algorithm, sampling=sampling)
            return
        key = ("round" if sampling is None else "sampled", algorithm, key_len)
        self._run(key, lambda: self._round_fn()(self.model, self.buf, self.cache, key_len,
                                                   self.bl, self.mask_id, algorithm, whole))

    def step_fused(self, algorithm: str, key_len: int, sampling: Any = None) -> bool:
        """`step`, fused with the refresh of the block in `prev_tokens`/`prev_positions`
        (`denoise_round_fused`): one forward of 2 blocks instead of a refresh + a round."""
        self.launch_fused(algorithm, key_len, sampling)
        return bool(self.buf.done)

    def launch_fused(self, algorithm: str, key_len: int, sampling: Any = None) -> None:
        """`step_fused` without reading the "done" flag."""
        whole = self._whole_round_sampling(sampling)
        if whole is False:
            logits = self._logits_buffer()
            fn = self._compiled("round_logits_fused", round_logits_fused)
            self._run(("logits_fused", key_len), lambda: fn(
                self.model, self.buf, self.prev_tokens, self.prev_positions, logits, self.cache,
                key_len, self.bl))
            decide(logits, self.buf, self.mask_id, algorithm, sampling=sampling)
            return
        fn = (denoise_round_fused if self.mode == "eager"
              else self._compiled("round_fused", denoise_round_fused))
        key = ("round_fused" if sampling is None else "sampled_fused", algorithm, key_len)
        self._run(key, lambda: fn(self.model, self.buf, self.prev_tokens, self.prev_positions,
                                  self.cache, key_len, self.bl, self.mask_id, algorithm, whole))

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> None:
        """K/V of `tokens` at `positions` (a prefill chunk or a finished block's refresh)."""
        n = tokens.shape[0]
        if self.mode != "graph":
            fn = self._compiled("fill", fill_kv) if self.mode == "compile" else fill_kv
            fn(self.model, tokens, positions, self.cache, key_len, self.bl)
            return
        if n not in self._fill_inputs:
            device = tokens.device
            self._fill_inputs[n] = (torch.zeros(n, dtype=torch.long, device=device),
                                    torch.zeros(n, dtype=torch.long, device=device))
        ids, pos = self._fill_inputs[n]
        ids.copy_(tokens)
        pos.copy_(positions)
        self._run(("fill", n, key_len), lambda: self._compiled("fill", fill_kv)(
            self.model, ids, pos, self.cache, key_len, self.bl))

    def _whole_round_sampling(self, sampling: Any) -> Any:
        """What the whole round function takes for `sampling`: None (greedy); the tuple itself
        when eager; for a compiled or captured round at a temperature alone, its
        `NoiseSampling`, the Exp(1) noise drawn now with the request's generator
        (`torch.multinomial` draws one sample from the same noise); False when the round
        cannot run whole (top-k / top-p, compiled: the logits path)."""
        if sampling is None or self.mode == "eager":
            return sampling
        temperature, top_k, top_p, generator = sampling
        if temperature <= 0.0 or top_k is not None or (top_p is not None and top_p < 1.0):
            return False
        if self.noise is None:
            device = self.cache.device
            with torch.inference_mode(False):  # static buffers are normal tensors
                self.noise = NoiseSampling(
                    torch.ones((), dtype=torch.float32, device=device),
                    torch.ones(self.bl, self.model.config.vocab_size, dtype=torch.float32,
                               device=device))
        self.noise.temperature.fill_(temperature)
        self.noise.noise.exponential_(1, generator=generator)
        return self.noise

    def _logits_buffer(self) -> torch.Tensor:
        """The static `[bl, V]` fp32 logits of sampled rounds, allocated on the first one (a
        greedy decoder never holds it). `decide` masks its `mask_id` column in place: harmless,
        every forward rewrites the whole buffer."""
        if self.logits is None:
            with torch.inference_mode(False):  # static buffers are normal tensors
                self.logits = torch.empty(self.bl, self.model.config.vocab_size,
                                          dtype=torch.float32, device=self.cache.device)
        return self.logits

    def _round_fn(self) -> Callable[..., Any]:
        return denoise_round if self.mode == "eager" else self._compiled("round", denoise_round)

    def _compiled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return compiled(name, fn, self.kernels)

    def _run(self, key: tuple[Any, ...], fn: Callable[[], None]) -> None:
        if self.mode != "graph":
            first = key not in self._graphs
            started = time.perf_counter()
            fn()
            if first and self.mode == "compile":
                self._graphs[key] = None  # type: ignore[assignment]
                self.compile_s += time.perf_counter() - started
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(fn)
            self._graphs[key] = graph
        graph.replay()

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm up (compile, autotune) and capture `fn`, leaving the round state unchanged."""
        started = time.perf_counter()
        saved = {f.name: getattr(self.buf, f.name).clone() for f in fields(self.buf)}
        graph, self._pool = capture_graph(fn, self._pool)
        for name, value in saved.items():
            getattr(self.buf, name).copy_(value)
        torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - started
        log.info("captured a round graph in %.1f s", time.perf_counter() - started)
        return graph
