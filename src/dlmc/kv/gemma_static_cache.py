"""DiffusionGemma's static KV cache: dense per-layer K/V buffers sized once, with the number of
encoded positions kept on the device.

The two layer kinds have their own shapes: sliding layers `[max_tokens, kv_heads, head_dim]`,
full layers `[max_tokens, global_kv_heads, global_head_dim]` (V is stored beside K on full layers
too: it is `v_norm` of the raw `k_proj` output, K its normed, rotated form). The encoder writes
K/V at the positions of the tokens it encodes and moves `length`; the decoder only reads. A
compiled round reads `length` on the device, so one captured graph serves every cache length
in its key-length bucket (see `dlmc.kv.gemma_round_attention`).
"""

from __future__ import annotations

import torch

from dlmc.errors import ConfigError
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig

__all__ = ["GemmaStaticCache"]


class GemmaStaticCache:
    """K/V of every layer of a DiffusionGemma model (one allocation per layer and tensor: a
    compiled round writes them in place; Inductor would copy a whole buffer to write a view of
    one). `length` (int64 `[]`) is how many positions, 0 .. length-1, hold encoded K/V."""

    def __init__(self, config: DiffusionGemmaConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"GemmaStaticCache max_tokens must be a positive integer, got "
                              f"{max_tokens!r}")
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, torch.device(device)
        layers = range(config.num_hidden_layers)
        self.windows: list[int | None] = [config.layer_window(i) for i in layers]
        shapes = [(max_tokens, config.layer_kv_heads(i), config.layer_head_dim(i)) for i in layers]
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for shape in shapes]
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def reset(self) -> None:
        """Forget every encoded position (the buffers keep their stale K/V, never attended)."""
        self.length.zero_()

    def write(self, layer_idx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V `[T, Hkv, D]` of the tokens at `positions [T]` (device int64, distinct)."""
        self.k[layer_idx].index_copy_(0, positions, k)
        self.v[layer_idx].index_copy_(0, positions, v)

    def nbytes(self) -> int:
        """Bytes of all K/V buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
