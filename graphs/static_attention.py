"""Attention over a static KV cache with a fixed key length: the context used inside compiled,
graph-captured rounds (no Python ints that change between rounds, no host syncs).

Every call writes the new tokens' K/V at their positions, then attends to the first `key_len`
cache slots under the block-causal rule `key // bl <= query // bl`. Slots of later blocks are
masked, so whatever they hold (zeros, padding, stale K/V) never counts.
"""

from __future__ import annotations

import torch

from dlmc.engine.attention import attention_reference
from dlmc.engine.kv_cache import DenseKVCache


class StaticCacheAttention:
    def __init__(
        self, cache: DenseKVCache, positions: torch.Tensor, key_len: int, block_length: int
    ) -> None:
        self.cache, self.positions, self.key_len = cache, positions, key_len
        key_pos = torch.arange(key_len, device=positions.device)
        allowed = (key_pos[None, :] // block_length) <= (positions[:, None] // block_length)
        zeros = torch.zeros(allowed.shape, dtype=cache.dtype, device=positions.device)
        self.mask = zeros.masked_fill(~allowed, float("-inf"))  # [T, key_len]

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.k[layer_idx].index_copy_(0, self.positions, k)
        self.cache.v[layer_idx].index_copy_(0, self.positions, v)
        keys = self.cache.k[layer_idx][: self.key_len]  # [key_len, Hkv, D]
        values = self.cache.v[layer_idx][: self.key_len]
        return attention_reference(q, keys, values, self.mask)
