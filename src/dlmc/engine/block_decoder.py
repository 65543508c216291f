"""The block decoder: whole-block canvas, KV cache of finished blocks, LLaDA2.0/2.1 rules.

Two ways to run a round, same rules (`dlmc.graphs.round.decide`):
- "static" (default): the pure round function over static buffers, eager, compiled or as a
  CUDA graph (`dlmc.graphs.runner`); greedy decoding, and sampling (temperature > 0) with the
  paged cache (the forward compiled / captured, the seeded decision eager).
- "reference": plain PyTorch with exact-length attention, cached or uncached; also used for
  sampling with the dense cache.
Cached decoding equals uncached decoding: a finished block's K/V are those of its final
tokens (the last round's when it changed nothing, else one refresh forward).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.engine.decode_config import DecodeConfig
from dlmc.engine.events import BlockEvent, DecodeOutput, RoundEvent
from dlmc.errors import ConfigError
from dlmc.graphs.in_flight import block_in_flight, may_queue_ahead
from dlmc.graphs.round import EDITS_OFF, RoundBuffers, decide
from dlmc.graphs.rules import step_quotas
from dlmc.graphs.runner import MAX_STEPS, RoundRunner
from dlmc.kv.attention import CachedAttention, MaskedAttention, block_causal_mask
from dlmc.kv.dense_cache import DenseKVCache
from dlmc.kv.layout import uses_paged_cache
from dlmc.kv.paged_cache import KVCacheConfig, PagedKVCache
from dlmc.kv.scales import KVScales

Event = RoundEvent | BlockEvent
PREFILL_CHUNK = 512
# How a finished block's stale K/V are rewritten from its final tokens (static rounds):
# "fused" into the next block's first round (one forward of 2 blocks), or "separate" (a
# refresh forward of its own). The refresh of the last block is skipped in both.
REFRESH_MODES = ("fused", "separate")


def prefill_chunk(block_length: int) -> int:
    """Tokens per prefill forward: whole blocks, at most PREFILL_CHUNK (at least one block)."""
    return max(block_length, PREFILL_CHUNK // block_length * block_length)


class BlockDecoder:
    """Runs one request at a time on `model`, reusing one static KV cache and round buffers.

    `mode`: "eager", "compile" or "graph" for the static round, or "reference".
    `lookahead`: static rounds (LLaDA2.1 rule) keep the next round queued while the host reads
    the last one's flags, as long as masks are left (`dlmc.graphs.in_flight`).
    `kernels`: the kernel choices of the cache's attention and the compiled rounds.
    """

    def __init__(
        self, model: torch.nn.Module, mask_id: int, eos_id: int, max_context: int,
        device: torch.device, dtype: torch.dtype, mode: str = "eager",
        kv_cache_dtype: str = "bf16", kv_scales: KVScales | None = None,
        refresh: str = "fused", kv_layout: str = "auto", lookahead: bool = True,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ) -> None:
        self.model, self.mask_id, self.eos_id = model, mask_id, eos_id
        self.max_context, self.device, self.dtype, self.mode = (
            max_context, device, dtype, mode)
        self.paged = uses_paged_cache(kv_layout, kv_cache_dtype, device, dtype, mode)
        if refresh not in REFRESH_MODES:
            raise ConfigError(f"refresh={refresh!r}: expected one of {', '.join(REFRESH_MODES)}")
        self.kv_cache_dtype, self.kv_scales, self.refresh = kv_cache_dtype, kv_scales, refresh
        if not isinstance(lookahead, bool):
            raise ConfigError(f"lookahead={lookahead!r}: expected True or False")
        self.lookahead = lookahead
        self.kernels = kernels
        self._cache: DenseKVCache | PagedKVCache | None = None
        self._runners: dict[int, RoundRunner] = {}

    @property
    def cache(self) -> DenseKVCache | PagedKVCache:
        """Paged (FP8 with the checkpoint's K/V scales, or BF16) or dense (BF16) cache. Made on
        first use, as normal tensors even when that is inside `torch.inference_mode` (a round
        run outside it may then still write them)."""
        if self._cache is None:
            with torch.inference_mode(False):
                self._cache = self._new_cache()
        return self._cache

    def _new_cache(self) -> DenseKVCache | PagedKVCache:
        cfg = self.model.config
        if self.paged:
            scales = self.kv_scales or KVScales.ones(cfg.num_hidden_layers)
            config = KVCacheConfig(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                   self.max_context,
                                   dtype="fp8" if self.kv_cache_dtype == "fp8" else "bf16")
            return PagedKVCache(config, self.device, k_scales=scales.k, v_scales=scales.v,
                                backend=self.kernels.attention_backend)
        return DenseKVCache(cfg.num_hidden_layers, self.max_context, cfg.num_key_value_heads,
                            cfg.head_dim, self.dtype, self.device)

    def runner(self, block_length: int) -> RoundRunner:
        if block_length not in self._runners:
            with torch.inference_mode(False):  # static buffers: normal tensors, as the cache
                self._runners[block_length] = RoundRunner(self.model, self.cache, block_length,
                                                          self.mask_id, self.mode, self.kernels)
        return self._runners[block_length]

    def decode(
        self, prompt_ids: list[int], cfg: DecodeConfig, use_cache: bool = True,
        rounds: bool = False, cancel: Callable[[], bool] | None = None,
    ) -> Generator[Event, None, DecodeOutput]:
        """Yield RoundEvents (if `rounds`) and BlockEvents; return the DecodeOutput."""
        bl, plen, gen_len = cfg.block_length, len(prompt_ids), cfg.max_new_tokens
        if plen == 0:
            raise ConfigError("prompt: expected at least one token")
        num_blocks = -(-(plen + gen_len) // bl)
        if num_blocks * bl > self.max_context:
            raise ConfigError(
                f"prompt ({plen} tokens) + max_new_tokens ({gen_len}) rounded up to whole blocks "
                f"of {bl} = {num_blocks * bl} tokens exceeds the model's context of "
                f"{self.max_context}"
            )
        paged = use_cache and self.paged
        static = use_cache and (cfg.greedy or paged) and self.mode != "reference"
        runner = self.runner(bl) if static else None
        if paged:
            self.cache.reset()
        buf = runner.buf if runner else RoundBuffers.allocate(bl, MAX_STEPS, self.device)
        canvas = torch.full((num_blocks * bl,), self.mask_id, dtype=torch.long, device=self.device)
        canvas[:plen] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(num_blocks * bl, device=self.device)
        first = plen // bl
        sampling = None
        if not cfg.greedy:
            gen = None
            if cfg.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
            sampling = (cfg.temperature, cfg.top_k, cfg.top_p, gen)
        total = self._prefill(canvas[: first * bl], bl, runner) if use_cache else 0
        forwards, finish, answer_end, b = 0, "length", plen + gen_len, first
        pending = False  # the previous block's refresh waits for this block's first round
        fused = 0
        with torch.inference_mode():
            for b in range(first, num_blocks):
                start = b * bl
                self._start_block(buf, canvas[start : start + bl], positions[start : start + bl],
                                  plen, cfg)
                if runner is not None and self.lookahead and not rounds:
                    n, cancelled = self._rounds_in_flight(
                        runner, cfg, runner.key_len(start + bl), pending, sampling, cancel)
                else:
                    n, cancelled = yield from self._rounds_one_by_one(
                        runner, buf, b, canvas, positions, pending, cfg, sampling, use_cache,
                        rounds, cancel)
                fused += pending and n > 0
                pending = pending and n == 0
                forwards += n
                total += n
                if cancelled:
                    finish = "cancelled"
                    break
                canvas[start : start + bl] = buf.tokens
                new_ids = canvas[max(start, plen) : min(start + bl, answer_end)].tolist()
                if self.eos_id in new_ids:
                    new_ids = new_ids[: new_ids.index(self.eos_id) + 1]
                    finish = "stop"
                last = finish != "length" or b == num_blocks - 1
                if use_cache and bool(buf.changed) and not last:  # stale K/V: refresh
                    if runner is not None and self.refresh == "fused":
                        runner.prev_tokens.copy_(buf.tokens)
                        runner.prev_positions.copy_(positions[start : start + bl])
                        pending = True
                    else:
                        self._fill(canvas[start : start + bl], positions[start : start + bl],
                                   bl, runner)
                        total += 1
                if paged and not pending:
                    self.cache.advance(bl)
                yield BlockEvent(b, tuple(new_ids), n)
                if finish != "length":
                    break
        answer = canvas[plen:answer_end].tolist()
        if self.eos_id in answer:
            answer = answer[: answer.index(self.eos_id) + 1]
        if finish == "cancelled":  # only the blocks that finished
            answer = answer[: max(0, b * bl - plen)]
        return DecodeOutput(tuple(answer), finish, forwards, total, b - first + 1, fused)

    def _rounds_one_by_one(
        self, runner: RoundRunner | None, buf: RoundBuffers, b: int, canvas: torch.Tensor,
        positions: torch.Tensor, pending: bool, cfg: DecodeConfig, sampling: Any,
        use_cache: bool, rounds: bool, cancel: Callable[[], bool] | None,
    ) -> Generator[Event, None, tuple[int, bool]]:
        """The rounds of block `b`, each read back before the next (RoundEvents if `rounds`):
        (rounds run, cancelled). `pending`: the first round carries the previous block's
        refresh (static rounds)."""
        bl = cfg.block_length
        start, n = b * bl, 0
        while True:
            if cancel is not None and cancel():
                return n, True
            if runner is not None and pending and n == 0:  # carries the previous block's refresh
                done = runner.step_fused(cfg.algorithm, runner.key_len(start + bl), sampling)
                if self.paged:
                    self.cache.advance(bl)
            elif runner is not None:
                done = runner.step(cfg.algorithm, runner.key_len(start + bl), sampling)
            else:
                logits = self._reference_logits(buf.tokens, start, bl, canvas, positions,
                                                use_cache)
                decide(logits, buf, self.mask_id, cfg.algorithm, cfg.num_to_transfer, sampling)
                done = bool(buf.done)
            n += 1
            if rounds:
                yield self._round_event(buf, b, n)
            if done:
                return n, False

    def _rounds_in_flight(
        self, runner: RoundRunner, cfg: DecodeConfig, key_len: int, pending: bool,
        sampling: Any, cancel: Callable[[], bool] | None,
    ) -> tuple[int, bool]:
        """The rounds of the block in `runner.buf`, the next one queued before the host reads
        the last one's flags wherever that one cannot end the block (`dlmc.graphs.in_flight`):
        the rounds, tokens and count of the one-by-one loop. The same rounds are launched in the
        same order, so a sampled decode draws the same numbers from its generator. Returns
        (rounds run, cancelled)."""

        def first() -> None:
            if pending:  # the first round carries the previous block's refresh
                runner.launch_fused(cfg.algorithm, key_len, sampling)
                if self.paged:
                    self.cache.advance(runner.bl)
            else:
                runner.launch(cfg.algorithm, key_len, sampling)

        if cancel is not None and cancel():
            return 0, True
        return block_in_flight(runner.flag_reads, first,
                               lambda: runner.launch(cfg.algorithm, key_len, sampling),
                               may_queue_ahead(cfg.algorithm, cfg.max_refine_steps), cancel)

    def _start_block(self, buf: RoundBuffers, tokens: torch.Tensor, positions: torch.Tensor,
                     plen: int, cfg: DecodeConfig) -> None:
        buf.tokens.copy_(tokens)
        buf.positions.copy_(positions)
        buf.editable.copy_(positions >= plen)
        buf.threshold.fill_(cfg.threshold)
        buf.edit_threshold.fill_(EDITS_OFF if cfg.edit_threshold is None else cfg.edit_threshold)
        buf.max_post.fill_(cfg.max_refine_steps)
        steps = min(cfg.steps, cfg.max_new_tokens, buf.quotas.numel())
        quotas = step_quotas(cfg.block_length, steps)
        buf.quotas[:steps].copy_(torch.tensor(quotas))
        buf.steps.fill_(steps)
        for counter in (buf.post, buf.step):
            counter.zero_()
        buf.changed.fill_(True)

    def _round_event(self, buf: RoundBuffers, block: int, n: int) -> RoundEvent:
        tokens = buf.tokens.tolist()
        editable = buf.editable.tolist()
        return RoundEvent(block, n, tuple(tokens), tuple(not e for e in editable),
                          tuple(e and t == self.mask_id for e, t in zip(editable, tokens,
                                                                        strict=True)),
                          tuple(buf.committed.tolist()), tuple(buf.edited.tolist()))

    def _reference_logits(self, tokens: torch.Tensor, start: int, bl: int, canvas: torch.Tensor,
                          positions: torch.Tensor, use_cache: bool) -> torch.Tensor:
        """Logits `[bl, V]` of the block: over the KV cache (storing the block's K/V in its
        slots), or uncached over the whole canvas prefix with the block-causal mask."""
        if use_cache:
            ctx = CachedAttention(self.cache, start, store=True)
            return self.model(tokens, positions[start : start + bl], ctx)
        canvas[start : start + bl] = tokens
        upto = start + bl
        mask = block_causal_mask(positions[:upto], positions[:upto], bl, self.dtype)
        return self.model(canvas[:upto], positions[:upto], MaskedAttention(mask))[-bl:]

    def _fill(self, tokens: torch.Tensor, positions: torch.Tensor, bl: int,
              runner: RoundRunner | None) -> None:
        end = int(positions[-1]) + 1
        if runner is not None:
            runner.fill(tokens, positions, runner.key_len(end))
            return
        mask = block_causal_mask(positions, positions, bl, self.dtype)
        ctx = CachedAttention(self.cache, int(positions[0]), store=True, mask=mask)
        self.model(tokens, positions, ctx, compute_logits=False)

    def _prefill(self, prefix: torch.Tensor, bl: int, runner: RoundRunner | None) -> int:
        """K/V of the prompt's full blocks, block-causal, in fixed-size chunks (the last one
        padded with masks when the chunk size is static); returns the forwards run."""
        chunk = prefill_chunk(bl)
        count = 0
        with torch.inference_mode():
            for start in range(0, prefix.shape[0], chunk):
                ids = prefix[start : start + chunk]
                fits = start + chunk <= self.max_context
                if runner is not None and ids.shape[0] < chunk and fits:
                    pad = torch.full((chunk - ids.shape[0],), self.mask_id, device=self.device)
                    ids = torch.cat([ids, pad])
                pos = torch.arange(start, start + ids.shape[0], device=self.device)
                self._fill(ids, pos, bl, runner)
                if isinstance(self.cache, PagedKVCache):
                    self.cache.advance(min(chunk, prefix.shape[0] - start))
                count += 1
        return count
