"""Attention contexts: the engine's side of the model's attention seam.

`MaskedAttention` attends the given tokens to each other under an additive mask (full-sequence
forwards: `LLM.logits`, uncached decoding). `CachedAttention` attends new tokens to the first
`prefix_len` cached tokens plus themselves and can store their K/V in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlmc.kv.dense_cache import DenseKVCache


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain attention with GQA, as the LLaDA2 reference computes it.

    q `[T, Hq, D]`, k/v `[S, Hkv, D]`, mask `[T, S]` additive (0 / -inf) or None.
    Scores `q·kᵀ·scale + mask` in q's dtype, softmax in fp32, cast back, then `@ v`.
    Returns `[T, Hq, D]`.
    """
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    # Query head h reads KV head h // groups: group the query heads under their KV head
    # instead of repeating K/V (no [S, Hq, D] copies of the cache).
    q = q.reshape(tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [T, Hkv, G, D]
    scores = torch.einsum("tkgd,skd->kgts", q, k) * scale  # [Hkv, G, T, S]
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [Hkv, G, T, S]
    out = torch.einsum("kgts,skd->tkgd", probs, v)  # [T, Hkv, G, D]
    return out.reshape(tokens, num_q_heads, head_dim)


def block_causal_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    block_length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask `[T, S]`: query i sees key j iff `key_j // bl <= query_i // bl`."""
    allowed = (key_positions[None, :] // block_length) <= (query_positions[:, None] // block_length)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill(~allowed, float("-inf"))


@dataclass
class MaskedAttention:
    """Tokens attend each other under `mask [T, T]` (or unmasked if None)."""

    mask: torch.Tensor | None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return attention_reference(q, k, v, self.mask)


@dataclass
class CachedAttention:
    """New tokens attend `cache[:prefix_len]` plus themselves.

    `mask` (`[T, T]`, optional) restricts how the new tokens see each other (block-causal for a
    multi-block prefill chunk); with None they see each other bidirectionally (one block).
    With `store`, their K/V are written to cache slots `prefix_len .. prefix_len+T-1`; the
    cache's committed length is advanced by the engine, not here.
    """

    cache: DenseKVCache
    prefix_len: int
    store: bool
    mask: torch.Tensor | None = None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.store:
            self.cache.write(layer_idx, self.prefix_len, k, v)
        k_prefix, v_prefix = self.cache.read(layer_idx, self.prefix_len)
        keys = torch.cat([k_prefix, k], dim=0)  # [prefix+T, Hkv, D]
        values = torch.cat([v_prefix, v], dim=0)
        mask = None
        if self.mask is not None:
            prefix_part = self.mask.new_zeros(q.shape[0], self.prefix_len)
            mask = torch.cat([prefix_part, self.mask], dim=1)  # [T, prefix+T]
        return attention_reference(q, keys, values, mask)
