"""The denoising round as a pure function over static buffers.

`denoise_round` = forward of the block over the static KV cache -> proposal -> commit/edit
decision -> updated block tokens and a device-side "block done" flag. Buffers are mutated in
place; nothing is allocated per round outside the function and nothing syncs with the host,
so the same function runs eager, compiled (Inductor, fullgraph) or replayed as a CUDA graph.
`round_logits` is its forward alone, writing the logits into a static buffer: the compiled
part of a sampled round, whose seeded decision runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dlmc.graphs.rules import joint_threshold_step, propose, propose_with_noise, threshold_step
from dlmc.kv.dense_cache import DenseKVCache
from dlmc.kv.paged_cache import PagedKVCache
from dlmc.kv.round_attention import PagedRoundAttention, StaticCacheAttention

EDITS_OFF = 2.0  # an edit threshold no probability exceeds
# (temperature, top_k, top_p, generator) of a sampled round; None: greedy.
Sampling = tuple[float, int | None, float | None, torch.Generator | None]


class NoiseSampling(NamedTuple):
    """A sampled round (temperature only) as tensors, so that the whole round compiles and
    captures: the temperature (fp32 `[]`) and Exp(1) noise (fp32 `[bl, V]`) drawn with the
    request's generator before the round (`propose_with_noise`)."""

    temperature: torch.Tensor
    noise: torch.Tensor


@dataclass
class RoundBuffers:
    """Static device state of the block being decoded (allocated once per engine)."""

    tokens: torch.Tensor  # [bl] int64, the block (updated every round)
    positions: torch.Tensor  # [bl] int64, absolute positions of the block
    editable: torch.Tensor  # [bl] bool, not prompt
    threshold: torch.Tensor  # [] fp32
    edit_threshold: torch.Tensor  # [] fp32 (EDITS_OFF disables edits)
    max_post: torch.Tensor  # [] int32, post-fill rounds allowed (joint)
    quotas: torch.Tensor  # [max_steps] int32, commits per step (threshold decoding)
    steps: torch.Tensor  # [] int32, steps allowed (threshold decoding)
    post: torch.Tensor  # [] int32, post-fill rounds counted so far (joint)
    step: torch.Tensor  # [] int32, rounds run in this block
    done: torch.Tensor  # [] bool: no further round should run
    masks_left: torch.Tensor  # [] bool: editable masks remain after the last round
    changed: torch.Tensor  # [] bool: the last round changed a token
    committed: torch.Tensor  # [bl] bool, mask -> token in the last round
    edited: torch.Tensor  # [bl] bool, token -> token in the last round

    @classmethod
    def allocate(cls, block_length: int, max_steps: int, device: torch.device) -> RoundBuffers:
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        i32, b = torch.int32, torch.bool
        return cls(z(block_length, dtype=torch.long), z(block_length, dtype=torch.long),
                   z(block_length, dtype=b), z(dtype=torch.float32), z(dtype=torch.float32),
                   z(dtype=i32), z(max_steps, dtype=i32), z(dtype=i32), z(dtype=i32),
                   z(dtype=i32), z(dtype=b), z(dtype=b), z(dtype=b), z(block_length, dtype=b),
                   z(block_length, dtype=b))


def decide(
    logits: torch.Tensor,
    buf: RoundBuffers,
    mask_id: int,
    algorithm: str,
    num_to_transfer: int = 1,
    sampling: Sampling | NoiseSampling | None = None,
) -> None:
    """Commit/edit decision for `logits [bl, V]` of `buf.tokens`; updates `buf` in place."""
    tokens = buf.tokens
    active = buf.editable & (tokens == mask_id)  # [bl]
    any_active = active.any()
    logits[:, mask_id] = float("-inf")  # never propose the mask itself
    if isinstance(sampling, NoiseSampling):
        x0, p = propose_with_noise(logits, sampling.temperature, sampling.noise)
    else:
        x0, p = propose(logits, *sampling) if sampling is not None else propose(logits)
    if algorithm == "threshold":
        index = buf.step.clamp(max=buf.quotas.numel() - 1).reshape(1).long()
        quota = buf.quotas.index_select(0, index)[0]  # [], device-side lookup
        new, committed = threshold_step(tokens, x0, p, active, buf.threshold, quota)
        edited = torch.zeros_like(committed)
        step = buf.step + 1
        masks_left = (buf.editable & (new == mask_id)).any()
        done = ~masks_left | (step >= buf.steps)
    else:
        new, committed, edited = joint_threshold_step(
            tokens, x0, p, active, buf.editable, buf.threshold, buf.edit_threshold,
            num_to_transfer,
        )
        step = buf.step + 1
        # docs/llada2.md §5.4: a round with no masks left counts as a post-fill round; the next
        # round runs only while post <= max_post; a mask-free round that edits nothing ends it.
        masks_left = (buf.editable & (new == mask_id)).any()
        post = buf.post + (~masks_left).to(torch.int32)
        done = (~any_active & ~edited.any()) | (post > buf.max_post)
        buf.post.copy_(post)
    buf.changed.copy_((new != tokens).any())
    buf.tokens.copy_(new)
    buf.step.copy_(step)
    buf.done.copy_(done)
    buf.masks_left.copy_(masks_left)
    buf.committed.copy_(committed)
    buf.edited.copy_(edited)


def _attention(cache: DenseKVCache | PagedKVCache, positions: torch.Tensor, key_len: int,
               block_length: int, causal: bool) -> StaticCacheAttention | PagedRoundAttention:
    if isinstance(cache, PagedKVCache):
        return PagedRoundAttention(cache, block_length if causal else None)
    return StaticCacheAttention(cache, positions, key_len, block_length)


def denoise_round(
    model: torch.nn.Module,
    buf: RoundBuffers,
    cache: DenseKVCache | PagedKVCache,
    key_len: int,
    block_length: int,
    mask_id: int,
    algorithm: str,
    sampling: Sampling | NoiseSampling | None = None,
) -> None:
    """One round of the block in `buf` over `cache` (dense: keys `[0, key_len)`; paged: the
    cached prefix). Greedy unless `sampling` = (temperature, top_k, top_p, generator)."""
    logits = _block_logits(model, buf, cache, key_len, block_length)  # [bl, V] fp32
    decide(logits, buf, mask_id, algorithm, sampling=sampling)


def denoise_round_fused(
    model: torch.nn.Module,
    buf: RoundBuffers,
    prev_tokens: torch.Tensor,
    prev_positions: torch.Tensor,
    cache: DenseKVCache | PagedKVCache,
    key_len: int,
    block_length: int,
    mask_id: int,
    algorithm: str,
    sampling: Sampling | NoiseSampling | None = None,
) -> None:
    """The first round of a block fused with the refresh of the block before it.

    One forward over `[prev_tokens, buf.tokens]` (block-causal): the finished previous block
    (`prev_tokens`/`prev_positions`, final tokens whose cached K/V are stale) writes its final
    K/V, and the new block attends to it as if a separate refresh forward had run first. Only
    the new block's logits are computed; the decision is `denoise_round`'s. A paged cache must
    not have been advanced past the previous block yet (advance it after this round).
    """
    logits = _block_logits_fused(model, buf, prev_tokens, prev_positions, cache, key_len,
                                 block_length)  # [bl, V] fp32
    decide(logits, buf, mask_id, algorithm, sampling=sampling)


def round_logits(
    model: torch.nn.Module,
    buf: RoundBuffers,
    logits_out: torch.Tensor,
    cache: DenseKVCache | PagedKVCache,
    key_len: int,
    block_length: int,
) -> None:
    """`denoise_round`'s forward without its decision: the fp32 logits `[bl, V]` of
    `buf.tokens` copied into the static `logits_out [bl, V]` (a sampled round compiles and
    captures this, then runs `decide` eagerly on `logits_out`). `buf` is not changed."""
    logits_out.copy_(_block_logits(model, buf, cache, key_len, block_length))


def round_logits_fused(
    model: torch.nn.Module,
    buf: RoundBuffers,
    prev_tokens: torch.Tensor,
    prev_positions: torch.Tensor,
    logits_out: torch.Tensor,
    cache: DenseKVCache | PagedKVCache,
    key_len: int,
    block_length: int,
) -> None:
    """`denoise_round_fused`'s forward without its decision (see `round_logits`): refreshes
    the K/V of `prev_tokens` and writes the new block's fp32 logits into `logits_out [bl, V]`."""
    logits_out.copy_(_block_logits_fused(model, buf, prev_tokens, prev_positions, cache, key_len,
                                         block_length))


def _block_logits(model: torch.nn.Module, buf: RoundBuffers, cache: DenseKVCache | PagedKVCache,
                  key_len: int, block_length: int) -> torch.Tensor:
    ctx = _attention(cache, buf.positions, key_len, block_length, causal=False)
    return model(buf.tokens, buf.positions, ctx)  # [bl, V] fp32


def _block_logits_fused(
    model: torch.nn.Module, buf: RoundBuffers, prev_tokens: torch.Tensor,
    prev_positions: torch.Tensor, cache: DenseKVCache | PagedKVCache, key_len: int,
    block_length: int,
) -> torch.Tensor:
    tokens = torch.cat([prev_tokens, buf.tokens])
    positions = torch.cat([prev_positions, buf.positions])
    ctx = _attention(cache, positions, key_len, block_length, causal=True)
    return model(tokens, positions, ctx, logits_from=prev_tokens.shape[0])  # [bl, V] fp32


def fill_kv(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: DenseKVCache | PagedKVCache,
    key_len: int,
    block_length: int,
) -> None:
    """Write the K/V of `tokens [T]` at `positions [T]` (prompt prefill chunk or block refresh;
    block-causal inside the chunk)."""
    ctx = _attention(cache, positions, key_len, block_length, causal=True)
    model(tokens, positions, ctx, compute_logits=False)
