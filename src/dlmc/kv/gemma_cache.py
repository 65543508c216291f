"""DiffusionGemma's dense KV cache and the two attention contexts the engine runs it with.

Sliding and full layers have different K/V shapes (`head_dim` x `num_key_value_heads` vs
`global_head_dim` x `num_global_key_value_heads`), so each layer has its own `[capacity, Hkv,
D]` buffers, allocated once per request size. Every encoded position is kept; the contexts
apply the sliding windows as the model was trained: a sliding layer's encoder query at q sees
`q - window < j <= q`, and every canvas query sees the last `window - 1` cached positions plus
the whole canvas.

`EncoderAttention` is the encoder pass: the given clean tokens at `start ..` attend causally
and their K/V are written to the cache. `CanvasAttention` is the decoder pass: the canvas
attends bidirectionally to [cache ; canvas] and the cache is only read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlmc.errors import ConfigError
from dlmc.models.diffusion_gemma_attention import gemma_attention_reference
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig


class GemmaDenseCache:
    """K and V of the first `length` encoded positions, per layer `[capacity, Hkv, D]`.

    `length` is advanced by the engine once an encoder pass has written a chunk.
    """

    def __init__(self, layer_shapes: list[tuple[int, int]], capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layer_shapes, self.dtype, self.device = layer_shapes, dtype, torch.device(device)
        self.capacity, self.length = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.reserve(capacity)

    @classmethod
    def for_config(cls, config: DiffusionGemmaConfig, capacity: int, dtype: torch.dtype,
                   device: torch.device) -> GemmaDenseCache:
        shapes = [(config.layer_kv_heads(i), config.layer_head_dim(i))
                  for i in range(config.num_hidden_layers)]
        return cls(shapes, capacity, dtype, device)

    def reserve(self, capacity: int) -> None:
        """Empty the cache and make room for `capacity` positions (buffers only grow)."""
        self.length = 0
        if capacity <= self.capacity:
            return
        self.k = [torch.zeros((capacity, heads, dim), dtype=self.dtype, device=self.device)
                  for heads, dim in self.layer_shapes]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.capacity = capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v `[T, Hkv, D]` of positions `start .. start + T - 1`."""
        end = start + k.shape[0]
        if end > self.capacity:
            raise ConfigError(f"KV cache capacity exceeded: {end} positions > capacity "
                              f"{self.capacity} (reserve room for the request first)")
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def read(self, layer: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[end - first, Hkv, D]` of positions `first .. end - 1`."""
        return self.k[layer][first:end], self.v[layer][first:end]


def window_start(end: int, window: int | None) -> int:
    """First cached position a canvas after `end` cached positions sees: `end - (window - 1)`
    on a sliding layer (at least 0), 0 on a full layer (`window` None)."""
    return 0 if window is None else max(0, end - (window - 1))


@dataclass
class EncoderAttention:
    """Encoder pass over clean tokens at positions `start .. start + T - 1`: query q sees the
    keys `j <= q` (and `j > q - window` on sliding layers) of [cache ; tokens]; the tokens'
    K/V are written to the cache (the engine then advances `cache.length`)."""

    cache: GemmaDenseCache
    start: int

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        end = self.start + q.shape[0]
        self.cache.write(layer_idx, self.start, k, v)
        first = window_start(self.start, window)
        keys, values = self.cache.read(layer_idx, first, end)  # [end - first, Hkv, D]
        query_pos = torch.arange(self.start, end, device=q.device)  # [T]
        key_pos = torch.arange(first, end, device=q.device)  # [S]
        allowed = key_pos[None, :] <= query_pos[:, None]  # [T, S]
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        return gemma_attention_reference(q, keys, values, allowed, scale)


@dataclass
class CanvasAttention:
    """Decoder pass: every canvas query sees the cached positions `window_start(length) ..
    length - 1` and the whole canvas, unmasked; the cache is not written."""

    cache: GemmaDenseCache
    length: int

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        past_k, past_v = self.cache.read(layer_idx, window_start(self.length, window),
                                         self.length)
        keys = torch.cat([past_k, k])  # [S + C, Hkv, D]
        values = torch.cat([past_v, v])  # [S + C, Hkv, D]
        return gemma_attention_reference(q, keys, values, None, scale)
