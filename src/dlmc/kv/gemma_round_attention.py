"""DiffusionGemma's attention contexts for compiled, graph-captured rounds over a
`GemmaStaticCache`: fixed shapes per key-length bucket, the cache length read on the device, no
host syncs (the `GemmaAttentionContext` seam of `dlmc.models.diffusion_gemma`).

`key_len` (a Python int, the bucket) bounds the cache slots a round may attend on full layers;
it must be at least the cache length (`cache.length`, which the contexts read on the device).

- `CanvasRoundAttention` (the decoder pass): the canvas attends to the cached positions
  `[0, length)` plus the whole canvas on full layers; on sliding layers to the last
  `window - 1` cached positions `[length - window + 1, length)` (the same window for every
  canvas query) plus the whole canvas. The cache is only read.
- `EncodeRoundAttention` (the encoder pass): writes the chunk's K/V at its positions, then a
  query at position q attends the keys j <= q (and j > q - window on sliding layers).

A sliding layer reads a fixed-size window of slots gathered at a device-side offset once the
bucket is longer than the window needs (`window - 1` slots for the canvas, `window - 1 + T` for
a chunk of T tokens, each rounded up to a multiple of `ALIGN` so that the score and value
products keep aligned shapes: an odd key count sends cuBLAS to slow unaligned kernels);
otherwise it reads the bucket's slots under the window mask. Slots outside the rule (before the
window, later positions, padding, stale K/V, gathered indices below 0) are masked out, so
whatever they hold never counts.

With `triton=True` (`KernelConfig.gemma_attention="triton"`) the canvas attends through
`dlmc::paged_attention` instead: the cache's buffers viewed as in-order pages
(`GemmaStaticCache.paged`), the window anchored at the canvas start, the FP8 rows dequantized in
registers; the same rule, in one split and one merge launch per layer. Neither reads
`key_len`: one compiled step serves every cache length. So with an encoder chunk
(`dlmc::paged_attention_append`, causal, the window moving with each query).
"""

from __future__ import annotations

from typing import Any

import torch

from dlmc.custom_ops.paged_attention import paged_attention
from dlmc.errors import ConfigError
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.models.diffusion_gemma_attention import gemma_attention_reference

__all__ = ["ALIGN", "CanvasRoundAttention", "EncodeRoundAttention", "canvas_past_slots"]

ALIGN = 8  # gathered key counts are multiples of this (16 bytes of bf16)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def canvas_past_slots(window: int | None, key_len: int) -> int:
    """How many cache slots a canvas's layer reads at `key_len` (the window's masked ones too)."""
    span = _aligned(window - 1) if window is not None else key_len
    return min(span, key_len)


def _past_slots(cache: GemmaStaticCache, layer_idx: int, key_len: int, first: torch.Tensor | None,
                span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(slots [S] int64, keys [S, Hkv, D], values [S, Hkv, D])` of the cache: slots
    `first .. first + span - 1` gathered (indices below 0 read slot 0: the caller masks them)
    when `first` is given, else the bucket's slots `0 .. key_len - 1`; K/V in the activation
    dtype (an FP8 cache's rows dequantized, `GemmaStaticCache.read`)."""
    k_all, v_all = cache.k[layer_idx], cache.v[layer_idx]
    if first is None:
        slots = torch.arange(key_len, device=k_all.device)  # [key_len]
        return slots, *cache.read(layer_idx, k_all[:key_len], v_all[:key_len])
    slots = first + torch.arange(span, device=k_all.device)  # [span]
    index = slots.clamp(min=0)
    return slots, *cache.read(layer_idx, k_all.index_select(0, index),
                              v_all.index_select(0, index))


class CanvasRoundAttention:
    """The decoder pass over `cache` (read only): canvas queries see `[cached window ; canvas]`
    with the cache's device-side length; `key_len` is the full layers' bucket (>= length).
    `triton`: through `dlmc::paged_attention` over the cache's buffers viewed as pages (bf16
    activations; it reads the length on the device, so `key_len` is not used), else the plain
    PyTorch attention below."""

    def __init__(self, cache: GemmaStaticCache, key_len: int, triton: bool = False) -> None:
        self.cache, self.key_len, self.triton = cache, key_len, triton
        self._length32: torch.Tensor | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        """q `[C, Hq, D]`, k/v `[C, Hkv, D]` of the canvas -> `[C, Hq, D]`."""
        if self.triton:
            return self._paged(layer_idx, q, k, v, window, scale)
        length = self.cache.length
        span = canvas_past_slots(window, self.key_len)
        gather = span < self.key_len  # a sliding layer's aligned window, gathered
        first = length - span if gather else None
        slots, past_k, past_v = _past_slots(self.cache, layer_idx, self.key_len, first, span)
        valid = (slots < length) & (slots >= 0)  # [S]
        if window is not None:
            valid &= slots > length - window  # the last window - 1 cached positions
        keys = torch.cat([past_k, k])  # [S + C, Hkv, D]
        values = torch.cat([past_v, v])
        canvas = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)  # [C]
        allowed = torch.cat([valid, canvas])[None, :]  # [1, S + C], the same for every query
        return gemma_attention_reference(q, keys, values, allowed, scale)

    def _paged(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        if self._length32 is None:  # once per step: the op's int32 device-side prefix length
            self._length32 = self.cache.length.to(torch.int32).reshape(1)
        return _paged(self.cache, layer_idx, q, k, v, self._length32, softmax_scale=scale,
                      window=window)


def _paged(cache: GemmaStaticCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, prefix_len: torch.Tensor, **options: Any) -> torch.Tensor:
    """`dlmc::paged_attention` of a block (`q [T, Hq, D]`, its `k`/`v [T, Hkv, D]`) at the
    cache positions `prefix_len ..` over layer `layer_idx` of `cache` viewed as pages."""
    if q.dtype != torch.bfloat16:
        raise ConfigError(f"KernelConfig.gemma_attention='triton' needs bfloat16 activations, "
                          f"got {q.dtype} (use gemma_attention='torch')")
    k_pool, v_pool, table, k_scale, v_scale = cache.paged(layer_idx)
    return paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), k_pool, v_pool,
                           table, prefix_len, k_scale=k_scale, v_scale=v_scale, **options)


class EncodeRoundAttention:
    """The encoder pass of a chunk of tokens at `positions [T]` (device int64, consecutive):
    their K/V are written to `cache`, then each attends causally (within its window on sliding
    layers) to the cache. `key_len` (>= the chunk's last position + 1) is the bucket. The
    caller moves `cache.length` once the chunk is encoded. `triton`: through
    `dlmc::paged_attention_append`, which stores the chunk's K/V as it attends them (the chunk
    attends its own K/V as computed, not as stored: an FP8 cache's rounding is left out)."""

    def __init__(self, cache: GemmaStaticCache, positions: torch.Tensor, key_len: int,
                 triton: bool = False) -> None:
        self.cache, self.positions, self.key_len, self.triton = cache, positions, key_len, triton
        self._start32: torch.Tensor | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` of the chunk -> `[T, Hq, D]`."""
        if self.triton:  # stores K/V at positions[0] .. as it attends (causal, windowed)
            if self._start32 is None:
                self._start32 = self.positions[:1].to(torch.int32)
            return _paged(self.cache, layer_idx, q, k, v, self._start32, softmax_scale=scale,
                          window=window, causal_block=1, window_per_query=window is not None,
                          append=True)
        self.cache.write(layer_idx, self.positions, k, v)
        tokens = q.shape[0]
        span = _aligned(window - 1 + tokens) if window is not None else 0
        gather = window is not None and self.key_len > span
        first = self.positions[0] + tokens - span if gather else None
        slots, keys, values = _past_slots(self.cache, layer_idx, self.key_len, first, span)
        query = self.positions[:, None]  # [T, 1]
        allowed = (slots[None, :] <= query) & (slots[None, :] >= 0)  # [T, S]
        if window is not None:
            allowed &= slots[None, :] > query - window
        return gemma_attention_reference(q, keys, values, allowed, scale)
