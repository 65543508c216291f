"""The block decoder: whole-block canvas, KV cache of finished blocks, LLaDA2.0/2.1 rules.

Cached decoding equals uncached decoding: a finished block's K/V are those of its final
tokens (the last denoising forward's when it changed nothing, else one refresh forward).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from dlmc.engine.attention import CachedAttention, MaskedAttention, block_causal_mask
from dlmc.engine.decode_config import DecodeConfig
from dlmc.engine.events import BlockEvent, DecodeOutput, RoundEvent
from dlmc.engine.kv_cache import DenseKVCache
from dlmc.engine.rules import joint_threshold_step, propose, step_quotas, threshold_step
from dlmc.errors import ConfigError
from dlmc.models.llada2 import LLaDA2ForDiffusion

Event = RoundEvent | BlockEvent
PREFILL_CHUNK = 512


@dataclass
class _Block:
    index: int
    start: int
    tokens: torch.Tensor  # [bl]
    is_prompt: torch.Tensor  # [bl] bool


class BlockDecoder:
    """Runs one request at a time on `model`, reusing one static KV cache."""

    def __init__(
        self,
        model: LLaDA2ForDiffusion,
        mask_id: int,
        eos_id: int,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model, self.mask_id, self.eos_id = model, mask_id, eos_id
        self.max_context, self.device, self.dtype = max_context, device, dtype
        self._cache: DenseKVCache | None = None

    @property
    def cache(self) -> DenseKVCache:
        if self._cache is None:
            cfg = self.model.config
            self._cache = DenseKVCache(
                cfg.num_hidden_layers,
                self.max_context,
                cfg.num_key_value_heads,
                cfg.head_dim,
                self.dtype,
                self.device,
            )
        return self._cache

    def decode(
        self,
        prompt_ids: list[int],
        cfg: DecodeConfig,
        use_cache: bool = True,
        rounds: bool = False,
        cancel: Callable[[], bool] | None = None,
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
        canvas = torch.full((num_blocks * bl,), self.mask_id, dtype=torch.long, device=self.device)
        canvas[:plen] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        first = plen // bl
        generator = None
        if cfg.temperature > 0.0 and cfg.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        positions = torch.arange(num_blocks * bl, device=self.device)
        total = self._prefill(canvas[: first * bl], bl) if use_cache else 0
        forwards, finish, answer_end = 0, "length", plen + gen_len
        with torch.inference_mode():
            for b in range(first, num_blocks):
                start = b * bl
                block = _Block(
                    b,
                    start,
                    canvas[start : start + bl].clone(),
                    positions[start : start + bl] < plen,
                )

                def forward(tokens: torch.Tensor, start: int = start) -> torch.Tensor:
                    return self._denoise_forward(tokens, start, bl, canvas, positions, use_cache)

                steps = self._block_rounds(block, cfg, forward, generator, rounds, cancel)
                n_rounds, converged, cancelled = yield from steps
                forwards += n_rounds
                total += n_rounds
                if cancelled:
                    finish = "cancelled"
                    break
                canvas[start : start + bl] = block.tokens
                if use_cache and not converged and not cancelled:
                    self.model(
                        block.tokens,
                        positions[start : start + bl],
                        CachedAttention(self.cache, start, store=True),
                        compute_logits=False,
                    )
                    total += 1
                lo, hi = max(start, plen), min(start + bl, answer_end)
                new_ids = canvas[lo:hi].tolist()
                if self.eos_id in new_ids:
                    new_ids = new_ids[: new_ids.index(self.eos_id) + 1]
                    finish = "stop"
                yield BlockEvent(b, tuple(new_ids), n_rounds)
                if finish != "length":
                    break
        answer = canvas[plen:answer_end].tolist()
        if self.eos_id in answer:
            answer = answer[: answer.index(self.eos_id) + 1]
        if finish == "cancelled":  # only the blocks that finished
            answer = answer[: max(0, b * bl - plen)]
        return DecodeOutput(tuple(answer), finish, forwards, total, b - first + 1)

    def _denoise_forward(
        self,
        tokens: torch.Tensor,
        start: int,
        bl: int,
        canvas: torch.Tensor,
        positions: torch.Tensor,
        use_cache: bool,
    ) -> torch.Tensor:
        """Logits `[bl, V]` of the block at `start`: over the KV cache (storing the block's
        K/V in its slots), or uncached over the whole canvas prefix with the block-causal mask."""
        if use_cache:
            ctx = CachedAttention(self.cache, start, store=True)
            return self.model(tokens, positions[start : start + bl], ctx)
        canvas[start : start + bl] = tokens
        upto = start + bl
        mask = block_causal_mask(positions[:upto], positions[:upto], bl, self.dtype)
        return self.model(canvas[:upto], positions[:upto], MaskedAttention(mask))[-bl:]

    def _prefill(self, prefix: torch.Tensor, bl: int) -> int:
        """K/V of the prompt's full blocks, block-causal, in chunks; returns forwards run."""
        chunk = max(bl, PREFILL_CHUNK // bl * bl)
        count = 0
        with torch.inference_mode():
            for start in range(0, prefix.shape[0], chunk):
                ids = prefix[start : start + chunk]
                pos = torch.arange(start, start + ids.shape[0], device=self.device)
                mask = block_causal_mask(pos, pos, bl, self.dtype)
                ctx = CachedAttention(self.cache, start, store=True, mask=mask)
                self.model(ids, pos, ctx, compute_logits=False)
                count += 1
        return count

    def _block_rounds(self, block, cfg, forward, generator, rounds, cancel):
        """Denoise one block; yields RoundEvents; returns (rounds, converged, cancelled)."""
        editable = ~block.is_prompt
        quotas = step_quotas(cfg.block_length, min(cfg.steps, cfg.max_new_tokens))
        n, post, converged = 0, 0, False
        while True:
            if cancel is not None and cancel():
                return n, False, True
            active = editable & (block.tokens == self.mask_id)
            any_active = bool(active.any())
            if cfg.algorithm == "threshold":
                if not any_active or n >= len(quotas):
                    break
            else:
                post += 0 if any_active else 1
                if post > cfg.max_refine_steps:
                    break
            logits = forward(block.tokens)
            logits[:, self.mask_id] = float("-inf")  # never propose the mask itself
            x0, p = propose(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)
            if cfg.algorithm == "threshold":
                new, committed = threshold_step(
                    block.tokens, x0, p, active, cfg.threshold, quotas[n]
                )
                edited = torch.zeros_like(committed)
            else:
                new, committed, edited = joint_threshold_step(
                    block.tokens,
                    x0,
                    p,
                    active,
                    editable,
                    cfg.threshold,
                    cfg.edit_threshold,
                    cfg.num_to_transfer,
                )
            n += 1
            converged = not bool((new != block.tokens).any())
            block.tokens = new
            if rounds:
                yield RoundEvent(
                    block.index,
                    n,
                    tuple(new.tolist()),
                    tuple(block.is_prompt.tolist()),
                    tuple((editable & (new == self.mask_id)).tolist()),
                    tuple(committed.tolist()),
                    tuple(edited.tolist()),
                )
            if cfg.algorithm == "joint" and not any_active and not bool(edited.any()):
                break
        return n, converged, False
