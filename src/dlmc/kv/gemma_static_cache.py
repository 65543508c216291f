"""DiffusionGemma's static KV cache: dense per-layer K/V buffers sized once, with the number of
encoded positions kept on the device.

The two layer kinds have their own shapes: sliding layers `[max_tokens, kv_heads, head_dim]`,
full layers `[max_tokens, global_kv_heads, global_head_dim]` (V is stored beside K on full layers
too: it is `v_norm` of the raw `k_proj` output, K its normed, rotated form). The encoder writes
K/V at the positions of the tokens it encodes and moves `length`; the decoder only reads. A
compiled round reads `length` on the device, so one captured graph serves every cache length
in its key-length bucket (see `dlmc.kv.gemma_round_attention`).

With `fp8_scales` the buffers hold float8_e4m3fn: `write` stores `e4m3(clamp(x / scale, ±448))`
with the layer's K or V scale (an export's `k_scale` / `v_scale`, `dlmc.kv.scales`), and `read`
gives `fp8 * scale` in the activation dtype (`dtype`); without, they hold `dtype` as written.
"""

from __future__ import annotations

import math

import torch

from dlmc.errors import ConfigError
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.quant.nvfp4_format import e4m3

__all__ = ["GemmaStaticCache"]


class GemmaStaticCache:
    """K/V of every layer of a DiffusionGemma model (one allocation per layer and tensor: a
    compiled round writes them in place; Inductor would copy a whole buffer to write a view of
    one). `length` (int64 `[]`) is how many positions, 0 .. length-1, hold encoded K/V.

    `dtype`: the activation dtype (what `read` returns); `storage_dtype`: what the buffers hold
    (float8_e4m3fn with `fp8_scales`, else `dtype`); `k_scales` / `v_scales`: per-layer Python
    floats (1.0 without FP8)."""

    def __init__(self, config: DiffusionGemmaConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str, *, fp8_scales: KVScales | None = None) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"GemmaStaticCache max_tokens must be a positive integer, got "
                              f"{max_tokens!r}")
        layers = range(config.num_hidden_layers)
        self.fp8 = fp8_scales is not None
        scales = fp8_scales or KVScales.ones(config.num_hidden_layers)
        for kind, values in (("k", scales.k), ("v", scales.v)):
            if len(values) != config.num_hidden_layers:
                raise ConfigError(f"GemmaStaticCache: {len(values)} {kind} scales for "
                                  f"{config.num_hidden_layers} layers")
            bad = [i for i, s in enumerate(values) if not (math.isfinite(s) and s > 0)]
            if bad:
                raise ConfigError(f"GemmaStaticCache: {kind}_scale of layer {bad[0]} is "
                                  f"{values[bad[0]]}; expected a positive finite number")
        self.k_scales, self.v_scales = tuple(map(float, scales.k)), tuple(map(float, scales.v))
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, torch.device(device)
        self.storage_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        self.windows: list[int | None] = [config.layer_window(i) for i in layers]
        shapes = [(max_tokens, config.layer_kv_heads(i), config.layer_head_dim(i)) for i in layers]
        store = self.storage_dtype
        self.k = [torch.zeros(shape, dtype=store, device=self.device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=store, device=self.device) for shape in shapes]
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)
        self._paged: tuple[int, torch.Tensor, list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def kv_cache_dtype(self) -> str:
        """"fp8", or the activation dtype's name ("bfloat16", "float32", ...)."""
        return "fp8" if self.fp8 else str(self.dtype).removeprefix("torch.")

    def reset(self) -> None:
        """Forget every encoded position (the buffers keep their stale K/V, never attended)."""
        self.length.zero_()

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.fp8:
            return x.to(self.storage_dtype)
        return e4m3(x.float() / scale)

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V `[T, Hkv, D]` of the tokens at `positions [T]` (device int64, distinct),
        quantized with the layer's scales in an FP8 cache (stored by `index_put_`: CPU has no
        float8 `index_copy_`)."""
        k_new = self._store(k, self.k_scales[layer_idx])
        v_new = self._store(v, self.v_scales[layer_idx])
        if self.fp8:
            self.k[layer_idx].index_put_((positions,), k_new)
            self.v[layer_idx].index_put_((positions,), v_new)
        else:
            self.k[layer_idx].index_copy_(0, positions, k_new)
            self.v[layer_idx].index_copy_(0, positions, v_new)

    def read(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K/V rows (`k`, `v`: slices or gathers of `self.k[layer_idx]`,
        `self.v[layer_idx]`) in the activation dtype: `fp8 * scale` in an FP8 cache."""
        if not self.fp8:
            return k, v
        return ((k.float() * self.k_scales[layer_idx]).to(self.dtype),
                (v.float() * self.v_scales[layer_idx]).to(self.dtype))

    def paged(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor]:
        """Layer `layer_idx` as `dlmc::paged_attention` reads a cache: `(k_pool, v_pool,
        page_table, k_scale, v_scale)`, the buffers viewed as `[pages, page_size, Hkv, D]`
        pools in order (page `i` holds positions `i * page_size ..`), the scales as 1-element
        float32 tensors (ones without FP8). Built once per cache, on its device."""
        if self._paged is None:
            page = math.gcd(self.max_tokens, 64)
            table = torch.arange(self.max_tokens // page, dtype=torch.int32, device=self.device)
            scales = [torch.tensor([s], dtype=torch.float32, device=self.device)
                      for s in (*self.k_scales, *self.v_scales)]
            self._paged = (page, table, scales[:self.num_layers], scales[self.num_layers:])
        page, table, k_scales, v_scales = self._paged
        k, v = self.k[layer_idx], self.v[layer_idx]
        shape = (self.max_tokens // page, page, *k.shape[1:])
        return k.view(shape), v.view(shape), table, k_scales[layer_idx], v_scales[layer_idx]

    def nbytes(self) -> int:
        """Bytes of all K/V buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
