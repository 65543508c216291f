"""Dense KV cache of finished blocks: static buffers sized once per engine."""

from __future__ import annotations

import torch

from dlmc.errors import ConfigError


class DenseKVCache:
    """K and V of every layer: one `[max_tokens, Hkv, D]` tensor per layer, model's dtype.

    Allocated once; `write` stores a chunk at an offset, `read` returns the first n tokens.
    Each layer is its own allocation (not a view of one 4-D buffer) so that a compiled round
    writes it in place: Inductor turns a write into a view of a graph input into a copy of the
    whole buffer.
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
        shape = (max_tokens, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, torch.device(device)

    def write(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = offset + k.shape[0]
        if end > self.max_tokens:
            raise ConfigError(
                f"KV cache capacity exceeded: {end} tokens > max_tokens={self.max_tokens} "
                "(raise the engine's max context or shorten the request)"
            )
        self.k[layer][offset:end] = k
        self.v[layer][offset:end] = v

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:length], self.v[layer][:length]
