"""Dense KV cache of finished blocks: static buffers sized once per engine."""

from __future__ import annotations

import torch

from dlmc.errors import ConfigError


class DenseKVCache:
    """K and V of every layer, `[layers, max_tokens, Hkv, D]` in the model's dtype.

    Allocated once; `write` stores a chunk at an offset, `read` returns the first n tokens.
    """

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, max_tokens, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens

    def write(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = offset + k.shape[0]
        if end > self.max_tokens:
            raise ConfigError(
                f"KV cache capacity exceeded: {end} tokens > max_tokens={self.max_tokens} "
                "(raise the engine's max context or shorten the request)"
            )
        self.k[layer, offset:end] = k
        self.v[layer, offset:end] = v

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :length], self.v[layer, :length]
