"""Plain-PyTorch reference attention contexts for DiffusionGemma.

`GemmaKVCache` keeps every encoded position's K/V per layer (dense, nothing evicted; the
contexts apply the sliding windows). `CausalContext` is the encoder pass: the given tokens
attend causally to [cache ; themselves] within each sliding layer's window, and their K/V are
appended to the cache (when there is one). `CanvasContext` is the decoder pass: the canvas
attends bidirectionally to [cache ; canvas], on sliding layers to the last `window - 1` cached
positions only, and the cache is read, never written. Both assume the given tokens sit at the
positions right after the cache.
"""

from __future__ import annotations

import torch


def gemma_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention with GQA: q `[T, Hq, D]`, k/v `[S, Hkv, D]`, allowed `[T, S]` bool or None (all).

    Scores `q·kᵀ·scale` in q's dtype, masked, softmax in fp32, cast back, then `@ v`.
    Returns `[T, Hq, D]`.
    """
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.reshape(tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [T, Hkv, G, D]
    scores = torch.einsum("tkgd,skd->kgts", q, k) * scale  # [Hkv, G, T, S]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [Hkv, G, T, S]
    out = torch.einsum("kgts,skd->tkgd", probs, v)  # [T, Hkv, G, D]
    return out.reshape(tokens, num_q_heads, head_dim)


class GemmaKVCache:
    """Per-layer K/V `[C, Hkv, D]` of the C encoded positions (head sizes differ by layer)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self, layer_idx: int) -> int:
        keys = self.keys[layer_idx]
        return 0 if keys is None else keys.shape[0]

    def get(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cached K/V, or empty `[0, Hkv, D]` tensors shaped as `like`."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            empty = like.new_empty((0, *like.shape[1:]))
            return empty, empty
        return keys, values

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keys, values = self.get(layer_idx, k)
        self.keys[layer_idx] = torch.cat([keys, k])
        self.values[layer_idx] = torch.cat([values, v])


class CausalContext:
    """Encoder pass: query at position q sees keys `max(0, q - window + 1) .. q` (all keys
    `<= q` on full layers) of [cache ; given tokens]; the given tokens' K/V are appended to
    `cache` (if any). Without a cache it is causal attention over one whole sequence."""

    def __init__(self, cache: GemmaKVCache | None = None) -> None:
        self.cache = cache

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        start = 0
        keys, values = k, v
        if self.cache is not None:
            past_k, past_v = self.cache.get(layer_idx, k)
            start = past_k.shape[0]
            keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])  # [C+T, Hkv, D]
            self.cache.append(layer_idx, k, v)
        query_pos = torch.arange(start, start + q.shape[0], device=q.device)  # [T]
        key_pos = torch.arange(keys.shape[0], device=q.device)  # [C+T]
        allowed = key_pos[None, :] <= query_pos[:, None]  # [T, C+T]
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        return gemma_attention_reference(q, keys, values, allowed, scale)


class CanvasContext:
    """Decoder pass: every canvas query sees the last `window - 1` cached positions (the whole
    cache on full layers) and the whole canvas, unmasked; `cache` is only read."""

    def __init__(self, cache: GemmaKVCache) -> None:
        self.cache = cache

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        past_k, past_v = self.cache.get(layer_idx, k)
        if window is not None:
            first = max(past_k.shape[0] - (window - 1), 0)
            past_k, past_v = past_k[first:], past_v[first:]
        keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])  # [C'+T, Hkv, D]
        return gemma_attention_reference(q, keys, values, None, scale)
