"""Attention context over the paged (FP8 or BF16) KV cache for compiled, graph-captured rounds.

Each call stores the new tokens' K/V at the cache's device-side `prefix_len` (quantized to FP8
with the layer's scales; the length is advanced by the engine only once the tokens are final)
and attends the block's queries to the cached prefix plus the block's own BF16 K/V: on the
Triton backend one launch for BF16 caches (`dlmc::paged_attention_append`; FP8 caches and
`DLMC_FUSED_KV_APPEND=off`: `dlmc::kv_append`, then `dlmc::paged_attention`), see
`PagedKVCache.append_and_attend` and `fused_kv_append`. Where the cache allows it (FP8 caches on
the Triton backend, `DLMC_ROPE_KV_APPEND`), the model stores K/V from its norm/rope launch
instead: it asks `rope_append_target` for the cache arguments, calls
`dlmc::qk_norm_rope_append`, then `attend_appended`.
`causal_block` makes a multi-block prefill chunk block-causal.
"""

from __future__ import annotations

import torch

from dlmc.kv.paged_cache import PagedKVCache


class PagedRoundAttention:
    """The model's attention context over `cache` (see `AttentionContext` in models/llada2.py)."""

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
