"""Attention contexts of compiled, graph-captured rounds: no Python ints that change between
rounds, no host syncs (the `AttentionContext` seam of `dlmc.models.llada2`).

`StaticCacheAttention` runs over the dense cache with a fixed key length: each call writes the
new tokens' K/V at their positions, then attends to the first `key_len` cache slots under the
block-causal rule `key // bl <= query // bl`. Slots of later blocks are masked, so whatever they
hold (zeros, padding, stale K/V) never counts.

`PagedRoundAttention` runs over the paged (FP8 or BF16) cache: each call stores the new tokens'
K/V at the cache's device-side `prefix_len` (quantized to FP8 with the layer's scales; the
length is advanced by the engine only once the tokens are final) and attends the block's
queries to the cached prefix plus the block's own BF16 K/V (`PagedKVCache.append_and_attend`:
one `dlmc::paged_attention_append` launch for BF16 caches). For FP8 caches the model stores K/V
from its norm/rope launch instead: it asks `rope_append_target` for the cache arguments, calls
`dlmc::qk_norm_rope_append`, then `attend_appended`. `causal_block` makes a multi-block prefill
chunk block-causal.
"""

from __future__ import annotations

import torch

from dlmc.kv.attention import attention_reference
from dlmc.kv.dense_cache import DenseKVCache
from dlmc.kv.paged_cache import PagedKVCache

__all__ = ["PagedRoundAttention", "StaticCacheAttention"]


class StaticCacheAttention:
    """The model's attention context over a dense `cache`, keys `[0, key_len)`."""

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


class PagedRoundAttention:
    """The model's attention context over a paged `cache`."""

    def __init__(self, cache: PagedKVCache, causal_block: int | None = None) -> None:
        self.cache, self.causal_block = cache, causal_block

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.cache.append_and_attend(layer_idx, q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                            causal_block=self.causal_block)

    def rope_append_target(self, layer_idx: int) -> tuple[torch.Tensor, ...] | None:
        """`(k_cache, v_cache, page_table, offset, k_scale, v_scale)` of the layer for
        `qk_norm_rope_append`, or None where the cache appends by itself."""
        return self.cache.rope_append_target(layer_idx)

    def attend_appended(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """`attend` for K/V already stored with `rope_append_target`'s arguments."""
        return self.cache.attend(layer_idx, q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                 causal_block=self.causal_block)
