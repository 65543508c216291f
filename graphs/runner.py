"""The one compile site and the one capture site: runs `denoise_round` / `fill_kv` eager,
compiled (Inductor, fullgraph) or as CUDA graphs captured per key-length bucket.

A sampled round at a temperature alone draws its Exp(1) noise eagerly with the request's
generator (`torch.multinomial`'s own draw) and replays the whole round on it
(`NoiseSampling`); with top-k or top-p it compiles and captures only its forward
(`round_logits`, into a static logits buffer) and takes the seeded decision eagerly on it.

Buckets: the key length (cache slots a round may attend to) is rounded up to a power of two
(at least 256, at most the cache size); each (algorithm, bucket) is compiled and captured once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
import torch._inductor.config

from dlmc.engine.kv_cache import DenseKVCache
from dlmc.errors import ConfigError
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
from dlmc.kv.paged_cache import PagedKVCache

log = logging.getLogger(__name__)
MODES = ("eager", "compile", "graph")
MIN_BUCKET = 256
MAX_STEPS = 4096

_compiled: dict[str, Callable[..., Any]] = {}


def kernel_switches() -> str:
    """The `DLMC_*` kernel switches of this process (`DLMC_CACHE` aside), `NAME=value` sorted
    and joined by spaces; empty when none is set."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                    if k.startswith("DLMC_") and k != "DLMC_CACHE")


def user_inductor_cache_dir() -> str | None:
    """The user's TORCHINDUCTOR_CACHE_DIR, or None. Importing torch._dynamo (torch.library and
    torch._inductor.config do) sets the variable to Inductor's default directory, before this
    module can read it: a value equal to that default counts as unset. (Reading the variable
    alone made every process share the default directory, whatever its switches: session 18
    found a `DLMC_PDL=1` round replaying the graph compiled without it.)"""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if value is None:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


USER_INDUCTOR_CACHE_DIR = user_inductor_cache_dir()  # read at import, before any compile


def inductor_cache_dir() -> str:
    """Inductor's FX-graph and autotune caches persist in dlmc's cache directory (unless the
    user set TORCHINDUCTOR_CACHE_DIR), so a second start of the same model and shapes is fast.

    One directory per set of `kernel_switches()`: the switches choose code inside the bodies of
    dlmc's Triton ops, which Inductor expands after computing its FX-graph cache key, so one
    directory for all of them served a graph compiled under other switches (perf/results/s16/
    call1 and call2: `DLMC_MOE_COMBINE=inductor` replayed the `triton` graph)."""
    if USER_INDUCTOR_CACHE_DIR:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = USER_INDUCTOR_CACHE_DIR
        return USER_INDUCTOR_CACHE_DIR
    from dlmc.loading.hub import dlmc_cache_dir

    switches = kernel_switches()
    name = "inductor" + (f"-{hashlib.sha256(switches.encode()).hexdigest()[:12]}" if switches
                         else "")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path = str(dlmc_cache_dir() / name)
    return path


def _compile(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The single torch.compile site (specialises per key length and algorithm)."""
    if name not in _compiled:
        inductor_cache_dir()
        torch._inductor.config.fx_graph_cache = True
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled[name] = torch.compile(fn, fullgraph=True, dynamic=False,
                                        options=compile_options())
    return _compiled[name]


def compile_options() -> dict[str, Any]:
    """Inductor options of the compile site.

    - `DLMC_MAX_AUTOTUNE_GEMM=1` lets Inductor time its Triton GEMM templates against cuBLAS for
      every matmul shape (slower first start; the choices land in the autotune cache).
    - `DLMC_UNROLL_REDUCTIONS=N` (default 8, Inductor's own): reductions of at most N elements
      become unrolled pointwise sums. At 16 the torch form of the MoE combine (K + 1 = 9 terms,
      `DLMC_MOE_COMBINE=inductor`) is unrolled, but Inductor then launches it as a pointwise
      kernel of its own instead of fusing it into the next RMSNorm: no gain on the H200
      (3.330 vs 3.299 ms queued, perf/results/s16/call1).
    - `DLMC_DETERMINISTIC_COMPILE=1`: Inductor's deterministic mode (no timing-based choice of
      a reduction's block or warps), so that two compiles of one model give the same numbers.
      Without it two processes' graphs of the tiny NVFP4 model gave different first tokens
      (perf/README.md, session 18); in session 19 fresh compiles agreed with and without it,
      and it cost nothing in the NVFP4 round (3.070 vs 3.071 ms queued). Opt-in.
    - `DLMC_INDUCTOR_PDL` (default 1): Inductor launches its kernels with programmatic
      dependent launch (torch's `triton.enable_pdl`; torch itself keeps it to CUDA sm_90+), so
      each starts while the kernel before it finishes. It shortens queued rounds only, which
      rounds in flight now are: NVFP4 + FP8 round in flight 2.774 ms against 2.836-2.843
      without (H200, perf/README.md, session 33). `0` turns it off; a user's own
      `TORCHINDUCTOR_ENABLE_PDL` is left as set.
    """
    flag = os.environ.get("DLMC_MAX_AUTOTUNE_GEMM", "0")
    if flag not in ("0", "1"):
        raise ConfigError(f"DLMC_MAX_AUTOTUNE_GEMM={flag!r}: expected 0 or 1")
    deterministic = os.environ.get("DLMC_DETERMINISTIC_COMPILE", "0")
    if deterministic not in ("0", "1"):
        raise ConfigError(f"DLMC_DETERMINISTIC_COMPILE={deterministic!r}: expected 0 or 1")
    if deterministic == "1" and not hasattr(torch._inductor.config, "deterministic"):
        raise ConfigError("DLMC_DETERMINISTIC_COMPILE=1 needs a torch whose Inductor has a "
                          f"deterministic mode (2.10 or later; this is {torch.__version__})")
    unroll = os.environ.get("DLMC_UNROLL_REDUCTIONS", "8")
    if not unroll.isdigit() or not 1 <= int(unroll) <= 64:
        raise ConfigError(f"DLMC_UNROLL_REDUCTIONS={unroll!r}: expected an integer 1..64")
    pdl = os.environ.get("DLMC_INDUCTOR_PDL", "1")
    if pdl not in ("0", "1"):
        raise ConfigError(f"DLMC_INDUCTOR_PDL={pdl!r}: expected 0 or 1")
    options: dict[str, Any] = {"unroll_reductions_threshold": int(unroll)}
    if "TORCHINDUCTOR_ENABLE_PDL" not in os.environ:
        options["triton.enable_pdl"] = pdl == "1"
    if deterministic == "1":
        options["deterministic"] = True
    return options | ({"max_autotune_gemm": True} if flag == "1" else {})


class RoundRunner:
    """Static buffers + compiled/captured rounds for one model and block length."""

    def __init__(
        self, model: torch.nn.Module, cache: DenseKVCache | PagedKVCache, block_length: int,
        mask_id: int, mode: str,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"round mode {mode!r}: expected one of {', '.join(MODES)}")
        device = cache.device
        self.max_tokens = getattr(cache, "max_tokens", None) or cache.capacity
        if mode == "graph" and device.type != "cuda":
            raise ConfigError("round mode 'graph' needs a CUDA device (use 'compile' or 'eager')")
        self.model, self.cache, self.bl, self.mask_id, self.mode = (
            model, cache, block_length, mask_id, mode)
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
            fn = _compile("round_logits", round_logits)
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
            fn = _compile("round_logits_fused", round_logits_fused)
            self._run(("logits_fused", key_len), lambda: fn(
                self.model, self.buf, self.prev_tokens, self.prev_positions, logits, self.cache,
                key_len, self.bl))
            decide(logits, self.buf, self.mask_id, algorithm, sampling=sampling)
            return
        fn = (denoise_round_fused if self.mode == "eager"
              else _compile("round_fused", denoise_round_fused))
        key = ("round_fused" if sampling is None else "sampled_fused", algorithm, key_len)
        self._run(key, lambda: fn(self.model, self.buf, self.prev_tokens, self.prev_positions,
                                  self.cache, key_len, self.bl, self.mask_id, algorithm, whole))

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> None:
        """K/V of `tokens` at `positions` (a prefill chunk or a finished block's refresh)."""
        n = tokens.shape[0]
        if self.mode != "graph":
            fn = _compile("fill", fill_kv) if self.mode == "compile" else fill_kv
            fn(self.model, tokens, positions, self.cache, key_len, self.bl)
            return
        if n not in self._fill_inputs:
            device = tokens.device
            self._fill_inputs[n] = (torch.zeros(n, dtype=torch.long, device=device),
                                    torch.zeros(n, dtype=torch.long, device=device))
        ids, pos = self._fill_inputs[n]
        ids.copy_(tokens)
        pos.copy_(positions)
        self._run(("fill", n, key_len), lambda: _compile("fill", fill_kv)(
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
        return denoise_round if self.mode == "eager" else _compile("round", denoise_round)

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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        for name, value in saved.items():
            getattr(self.buf, name).copy_(value)
        torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - started
        log.info("captured a round graph in %.1f s", time.perf_counter() - started)
        return graph
