"""Paged KV cache of one sequence: preallocated FP8 or BF16 page pools for every layer.

Usage per denoising round (all layers share the prefix length):
    cache.check_capacity(block_len)          # host, before the round
    cache.plan(block_len)                    # host; FlashInfer only (no-op otherwise)
    out = cache.attend(layer, q, k, v, softmax_scale=...)   # cached prefix + the block
    cache.append(layer, k, v)                # only in the forward whose K/V are final
    cache.advance(block_len)                 # after every layer appended
or, storing the block's K/V in every forward (as dlmc's rounds do; the next forward overwrites
them until `advance`), `out = cache.append_and_attend(layer, q, k, v, softmax_scale=...)`: one
launch on the Triton backend for BF16 caches (`dlmc::paged_attention_append`; `fused_kv_append`
says when), else `kv_append` then `attend`. When `rope_append_target(layer)` gives the
arguments (FP8 caches on the Triton backend), the model stores the block's K/V from its
`qk_norm_rope_append` launch instead and calls `attend`, which does not append.
`attend` and `append` read the prefix length from a device tensor and never sync, so a round
that calls them can be captured once in a CUDA graph and replayed at any prefix length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dlmc.custom_ops.kv_append import kv_append, kv_append_reference
from dlmc.custom_ops.paged_attention import paged_attention
from dlmc.errors import ConfigError

BACKENDS = ("auto", "triton", "flashinfer", "reference")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape of a paged cache: `num_layers` layers of `[num_pages, page_size, Hkv, D]` pools.

    `max_tokens` (the option that bounds the context) is rounded up to whole pages.
    `dtype`: `"bf16"` or `"fp8"` (float8_e4m3fn with per-layer `k_scale`/`v_scale`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    page_size: int = 16
    dtype: Literal["bf16", "fp8"] = "bf16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"KVCacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _TORCH_DTYPES:
            raise ConfigError(f"KVCacheConfig.dtype must be 'bf16' or 'fp8', got {self.dtype!r}")

    @property
    def num_pages(self) -> int:
        return math.ceil(self.max_tokens / self.page_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]


def fused_kv_append(dtype: str) -> bool:
    """Whether the Triton backend stores a round's K/V from the attention's own split kernel
    (one launch per layer) for a cache of `dtype`: BF16 caches only. FP8 caches store them from
    the model's norm/rope launch instead (`rope_append_target`), which measured faster inside
    whole rounds (docs/paged_attention.md)."""
    return dtype == "bf16"


def default_backend(device: torch.device) -> str:
    """The fastest measured backend: Triton on CUDA (docs/paged_attention.md), the reference
    on CPU."""
    return "triton" if device.type == "cuda" else "reference"


class PagedKVCache:
    """K/V pools (per layer `[num_pages, page_size, Hkv, D]`), one page table, per-layer scales.

    Attributes:
        prefix_len: `[1]` int32 device tensor, the committed length (read by the kernels).
        length: the same value on the host (capacity checks, FlashInfer planning).
        k_scale, v_scale: `[num_layers]` float32 device tensors (ones for BF16).
        page_table: `[num_pages]` int32; pages are handed out in order (one sequence).
        fused_append: whether `append_and_attend` is one launch (the Triton backend with
            `fused_kv_append(dtype)`, or the constructor's `fused_append`).
        rope_append: whether the append may be folded into `qk_norm_rope_append` (the Triton
            backend without `fused_append`); see `rope_append_target`.
    """

    def __init__(
        self, config: KVCacheConfig, device: torch.device | str, *,
        k_scales: Sequence[float] | None = None, v_scales: Sequence[float] | None = None,
        backend: str = "auto", num_q_heads: int | None = None, fused_append: bool | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        if backend not in BACKENDS:
            raise ConfigError(f"attention backend={backend!r} is not one of {', '.join(BACKENDS)}")
        self.backend = default_backend(self.device) if backend == "auto" else backend
        if fused_append is None:  # FlashInfer and the reference append, then attend
            fused_append = fused_kv_append(config.dtype)
        self.fused_append = fused_append and self.backend == "triton"
        self.rope_append = self.backend == "triton" and not self.fused_append
        # One allocation per layer, not views of one 5-D pool: Inductor turns a kernel's write
        # into a view of a graph input into a copy of the whole pool.
        shape = (config.num_pages, config.page_size, config.num_kv_heads, config.head_dim)
        self.dtype = config.torch_dtype
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                  for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                  for _ in range(config.num_layers)]
        self.page_table = torch.arange(config.num_pages, dtype=torch.int32, device=self.device)
        self.prefix_len = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.length = 0
        fp8 = config.dtype == "fp8"
        self.k_scales_host = self._scales("k_scales", k_scales if fp8 else None)
        self.v_scales_host = self._scales("v_scales", v_scales if fp8 else None)
        self.k_scale = torch.tensor(self.k_scales_host, dtype=torch.float32, device=self.device)
        self.v_scale = torch.tensor(self.v_scales_host, dtype=torch.float32, device=self.device)
        self._flashinfer = None
        if self.backend == "flashinfer":
            from dlmc.custom_ops.paged_attention_flashinfer import FlashInferPagedAttention

            if num_q_heads is None:
                raise ConfigError("backend='flashinfer' needs num_q_heads (fixed per wrapper)")
            self._flashinfer = FlashInferPagedAttention(
                num_q_heads=num_q_heads, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, page_size=config.page_size,
                max_pages=config.num_pages, kv_dtype=config.torch_dtype, device=self.device)

    def _scales(self, name: str, values: Sequence[float] | None) -> tuple[float, ...]:
        if values is None:
            return (1.0,) * self.config.num_layers
        values = tuple(float(x) for x in values)
        if len(values) != self.config.num_layers or not all(
                math.isfinite(x) and x > 0 for x in values):
            raise ConfigError(f"PagedKVCache {name} must be {self.config.num_layers} positive "
                              f"finite numbers, got {values}")
        return values

    @property
    def capacity(self) -> int:
        """Tokens the pools hold (`max_tokens` rounded up to whole pages)."""
        return self.config.num_pages * self.config.page_size

    def check_capacity(self, num_new: int) -> None:
        """Raise `ConfigError` unless `num_new` more tokens fit (host check, call per round)."""
        if self.length + num_new > self.capacity:
            raise ConfigError(
                f"KV cache full: {self.length} cached + {num_new} new tokens > "
                f"max_tokens={self.config.max_tokens} (page_size={self.config.page_size}); "
                "raise the engine's max_tokens option or shorten the request")

    def reset(self) -> None:
        """Forget every cached token (the pools are kept)."""
        self.length = 0
        self.prefix_len.zero_()

    def advance(self, num_tokens: int) -> None:
        """Commit `num_tokens` appended tokens: host length and device prefix_len both move."""
        self.check_capacity(num_tokens)
        self.length += num_tokens
        self.prefix_len.add_(num_tokens)

    def plan(self, num_queries: int, softmax_scale: float) -> None:
        """Host-side planning before a round (FlashInfer only; call outside graph capture)."""
        if self._flashinfer is not None:
            self.check_capacity(num_queries)
            self._flashinfer.plan(self.length + num_queries, num_queries, self.page_table,
                                 softmax_scale)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the block's K/V `[T, Hkv, D]` at positions `prefix_len ..` of `layer`.

        Quantizes to FP8 with the layer's scales. Does not advance (see `advance`).
        """
        append = kv_append_reference if self.backend == "reference" else kv_append
        append(k, v, self.k[layer], self.v[layer], self.page_table, self.prefix_len,
               k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])

    def rope_append_target(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """The cache arguments of `layer` for `qk_norm_rope_append`, `(k_cache, v_cache,
        page_table, offset, k_scale, v_scale)` (offset `prefix_len`), when `rope_append`; else
        None. Whoever stores the block's K/V with them calls `attend`, not `append_and_attend`.
        """
        if not self.rope_append:
            return None
        return (self.k[layer], self.v[layer], self.page_table, self.prefix_len,
                self.k_scale[layer], self.v_scale[layer])

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        softmax_scale: float, window: int | None = None, causal_block: int | None = None,
    ) -> torch.Tensor:
        """Attention of the block, q `[T, Hq, D]`, over the cache plus its own k/v `[T, Hkv, D]`.

        Returns `[T, Hq, D]` bfloat16. See `dlmc.custom_ops.paged_attention` for `window` and
        `causal_block`. The FlashInfer backend first writes k/v (quantized) into the slots after
        the prefix, then attends the cache; it supports neither `window` nor `causal_block`.
        """
        if self._flashinfer is not None:
            if window is not None or causal_block is not None:
                raise ConfigError("backend='flashinfer' supports neither window nor "
                                  "causal_block; use backend='triton'")
            self.append(layer, k, v)
            return self._flashinfer.run(q, self.k[layer], self.v[layer],
                                        k_scale=self.k_scales_host[layer],
                                        v_scale=self.v_scales_host[layer])
        return self._paged_attention(layer, q, k, v, softmax_scale, window, causal_block,
                                     append=False)

    def _paged_attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        softmax_scale: float, window: int | None, causal_block: int | None, append: bool,
    ) -> torch.Tensor:
        return paged_attention(
            q, k, v, self.k[layer], self.v[layer], self.page_table, self.prefix_len,
            k_scale=self.k_scale[layer], v_scale=self.v_scale[layer],
            softmax_scale=softmax_scale, window=window, causal_block=causal_block,
            backend=self.backend, append=append)

    def append_and_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        softmax_scale: float, window: int | None = None, causal_block: int | None = None,
    ) -> torch.Tensor:
        """`append(layer, k, v)` then `attend(layer, q, k, v, ...)`, with the same results.

        With `fused_append` (Triton backend) one `dlmc::paged_attention_append` launch does
        both: the split kernel that attends the block's own K/V also stores them. Otherwise
        the two calls (FlashInfer's `attend` appends by itself, so it is called alone).
        """
        if self.fused_append:
            return self._paged_attention(layer, q, k, v, softmax_scale, window, causal_block,
                                         append=True)
        if self._flashinfer is None:
            self.append(layer, k, v)
        return self.attend(layer, q, k, v, softmax_scale=softmax_scale, window=window,
                           causal_block=causal_block)
