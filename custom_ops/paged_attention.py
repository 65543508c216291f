"""`dlmc::paged_attention`: a block of queries attends a paged (FP8 or BF16) KV cache + itself.

Design: the block's own K/V are passed separately in BF16 and are NOT read from the cache, so a
denoising forward, whose K/V are provisional, can run it inside a CUDA graph with a fixed block
length while the prefix length lives in a device tensor. Keeping the block in BF16 also keeps the
FP8 error to the cached prefix. Two ops: `dlmc::paged_attention` is pure (it never writes the
cache; storing K/V is then `dlmc::kv_append`), `dlmc::paged_attention_append` also stores the
block's K/V at `prefix_len ..` exactly as `dlmc::kv_append` would (same FP8 rounding, same
dropped positions past capacity) from the split kernel that attends them, saving a launch; it
mutates `k_cache`/`v_cache`. The attention output is the same either way (the cache splits read
only positions below `prefix_len`).

Backends: `"triton"` (the op; portable, graph-capturable, runs under `TRITON_INTERPRET=1` on
CPU) and `"reference"` (plain PyTorch, syncs on `prefix_len`; CPU tests and debugging).
FlashInfer needs host-side planning and lives in `paged_attention_flashinfer.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.kv_append import kv_append_reference
from dlmc.errors import ConfigError

from ._paged_attention_launch import (
    DEFAULT_MIN_SPLIT_KEYS,
    SWEEP_VARIANTS,
    PagedAttentionVariant,
    default_num_splits,
    launch_paged_attention,
)

CACHE_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
BACKENDS = ("triton", "reference")
__all__ = ["DEFAULT_MIN_SPLIT_KEYS", "SWEEP_VARIANTS", "PagedAttentionVariant",
           "default_num_splits", "launch_paged_attention", "paged_attention",
           "paged_attention_reference"]


def _launch_op(append: bool) -> Callable[..., torch.Tensor]:
    """The body of `dlmc::paged_attention` (append False) or `dlmc::paged_attention_append`."""

    def launch(
        q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor,
        k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float, window: int,
        causal_block: int, num_splits: int, window_per_query: bool = False,
    ) -> torch.Tensor:
        return launch_paged_attention(q, k_new, v_new, k_cache, v_cache, page_table, prefix_len,
                                      k_scale, v_scale, softmax_scale, window, causal_block,
                                      num_splits, append=append,
                                      window_per_query=window_per_query)

    return launch


def paged_attention_fake(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float, window: int,
    causal_block: int, num_splits: int, window_per_query: bool = False,
) -> torch.Tensor:
    """Fake (meta) function of both ops: the output has q's shape, dtype and strides; reads no
    data (the appending op's cache writes are declared by `mutates_args`)."""
    return torch.empty_like(q)


_paged_attention_op = traced_triton_op("dlmc::paged_attention", _launch_op(False),
                                       paged_attention_fake)
_paged_attention_append_op = traced_triton_op(
    "dlmc::paged_attention_append", _launch_op(True), paged_attention_fake,
    mutates_args=("k_cache", "v_cache"))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(f"paged_attention: {message}")


def validate_paged_attention_args(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> None:
    """Raise `ConfigError` naming the tensor when a shape, dtype or device is not supported."""
    _check(q.dim() == 3 and q.dtype == torch.bfloat16,
           f"q must be [Tq, Hq, D] bfloat16, got {tuple(q.shape)} {q.dtype}")
    num_queries, num_q_heads, head_dim = q.shape
    _check(head_dim in (16, 32, 64, 128, 256, 512),
           f"head dim {head_dim} unsupported (expected a power of two from 16 to 512)")
    _check(k_cache.dim() == 4 and k_cache.dtype in CACHE_DTYPES,
           f"k_cache must be [num_pages, page_size, Hkv, D] float8_e4m3fn or bfloat16, got "
           f"{tuple(k_cache.shape)} {k_cache.dtype}")
    _check(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
           and v_cache.stride() == k_cache.stride(),
           f"v_cache must match k_cache {tuple(k_cache.shape)} {k_cache.dtype} (same strides)")
    num_kv_heads = k_cache.shape[2]
    _check(k_cache.shape[3] == head_dim, f"k_cache head dim {k_cache.shape[3]} != q's {head_dim}")
    _check(num_q_heads % num_kv_heads == 0,
           f"Hq={num_q_heads} is not a multiple of the cache's Hkv={num_kv_heads}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        _check(t.shape == (num_queries, num_kv_heads, head_dim) and t.dtype == torch.bfloat16,
               f"{name} must be [{num_queries}, {num_kv_heads}, {head_dim}] bfloat16, got "
               f"{tuple(t.shape)} {t.dtype}")
    _check(k_new.stride() == v_new.stride(), "k_new and v_new must have the same strides")
    for name, t in (("q", q), ("k_new", k_new), ("k_cache", k_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in its last (head) dim")
    _check(page_table.dim() == 1 and page_table.dtype == torch.int32,
           f"page_table must be 1-D int32, got {tuple(page_table.shape)} {page_table.dtype}")
    _check(prefix_len.numel() == 1 and prefix_len.dtype == torch.int32,
           f"prefix_len must be a 1-element int32 tensor, got {tuple(prefix_len.shape)} "
           f"{prefix_len.dtype}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(t.numel() == 1 and t.dtype == torch.float32,
               f"{name} must be a 1-element float32 tensor, got {tuple(t.shape)} {t.dtype}")
    tensors = (k_new, v_new, k_cache, v_cache, page_table, prefix_len, k_scale, v_scale)
    _check(all(t.device == q.device for t in tensors),
           f"every tensor must be on q's device {q.device}")


def paged_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor, *,
    k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float,
    window: int | None = None, causal_block: int | None = None, num_splits: int | None = None,
    backend: str = "triton", append: bool = False, window_per_query: bool = False,
) -> torch.Tensor:
    """Attention of a block of `Tq` queries over the cached prefix plus the block itself.

    Args:
        q: `[Tq, Hq, D]` bfloat16 queries (after qk-norm and RoPE). D in 16..512, power of two.
        k_new, v_new: `[Tq, Hkv, D]` bfloat16 K/V of the same block; not read from the cache.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]` float8_e4m3fn or bfloat16 pools.
        page_table: `[max_pages]` int32; cached token `j` is at
            `cache[page_table[j // page_size], j % page_size]`.
        prefix_len: 1-element int32 tensor on the device: cached tokens `0 .. prefix_len-1` are
            visible (clamped to the table's capacity). Read on the device only (no host sync).
        k_scale, v_scale: 1-element float32 tensors; cached values are `fp8 * scale`. Pass ones
            for a BF16 cache.
        softmax_scale: multiplies `q·k` (LLaDA2: `D**-0.5`; DiffusionGemma: 1.0).
        window: sliding-window size as in the model config (DiffusionGemma: 1024), anchored at
            the block start: the block sees cached tokens `j >= prefix_len - (window - 1)`
            (DiffusionGemma's canvas: the last `window - 1` cached positions, plus the whole
            block).
        causal_block: None = the block's queries see all its keys (bidirectional); `b` = query
            `t` sees block key `s` iff `s // b <= t // b` (block-causal prefill; 1 = causal).
        num_splits: key splits of the prefix (None: a fixed heuristic from shapes and capacity).
        backend: `"triton"` (default) or `"reference"`.
        append: also store `k_new`/`v_new` at positions `prefix_len .. prefix_len+Tq-1` of the
            caches (mutated), exactly as `kv_append` (FP8: `e4m3(clamp(x / scale, ±448))`;
            positions past the table's capacity dropped). Triton: one launch,
            `dlmc::paged_attention_append`, whose split kernel writes them as it attends them;
            reference: `kv_append_reference`, then the attention. The output does not change:
            the block attends its own K/V in BF16 either way. False (default): the pure
            `dlmc::paged_attention`, the caches untouched.
        window_per_query: the window moves with each query (needs `window`): block query `t`,
            at position `p = prefix_len + t`, sees keys at positions `>= p - (window - 1)`,
            cached or in the block (with `causal_block=1`: keys `p-window+1 .. p`, an encoder
            chunk's sliding window). False (default): anchored at the block start, above.

    V = K (DiffusionGemma's full layers keep no V projection): the same tensors may be passed
    as `k_cache` and `v_cache`, `k_new` and `v_new`, `k_scale` and `v_scale`.

    GQA: query head `h` reads KV head `h // (Hq // Hkv)`. Softmax in fp32 over
    `q·kᵀ·softmax_scale`. Returns `[Tq, Hq, D]` bfloat16.
    """
    validate_paged_attention_args(q, k_new, v_new, k_cache, v_cache, page_table, prefix_len,
                                  k_scale, v_scale)
    _check(window is None or window >= 1, f"window must be None or >= 1, got {window}")
    _check(causal_block is None or causal_block >= 1,
           f"causal_block must be None or >= 1, got {causal_block}")
    _check(not window_per_query or window is not None,
           "window_per_query=True needs a window (the window that moves with each query)")
    if backend == "reference":
        if append:
            kv_append_reference(k_new, v_new, k_cache, v_cache, page_table, prefix_len,
                                k_scale=k_scale, v_scale=v_scale)
        return paged_attention_reference(
            q, k_new, v_new, k_cache, v_cache, page_table, prefix_len, k_scale=k_scale,
            v_scale=v_scale, softmax_scale=softmax_scale, window=window,
            causal_block=causal_block, window_per_query=window_per_query)
    _check(backend == "triton", f"backend={backend!r} is not one of {BACKENDS} (FlashInfer: "
           "use PagedKVCache(backend='flashinfer'), which plans on the host)")
    op = torch.ops.dlmc.paged_attention_append if append else torch.ops.dlmc.paged_attention
    return op(q, k_new, v_new, k_cache, v_cache, page_table, prefix_len.reshape(1),
              k_scale.reshape(1), v_scale.reshape(1), float(softmax_scale), window or 0,
              causal_block or 0, num_splits or 0, window_per_query)


def gather_prefix(cache: torch.Tensor, page_table: torch.Tensor, start: int, end: int,
                  scale: torch.Tensor) -> torch.Tensor:
    """Dequantized cached tokens `start .. end-1` of one pool as fp32 `[end-start, Hkv, D]`."""
    page_size = cache.shape[1]
    positions = torch.arange(start, end, device=cache.device)
    pages = page_table.reshape(-1)[positions // page_size].long()
    return cache[pages, positions % page_size].float() * scale.float().reshape(())


def paged_attention_reference(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor, *,
    k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float,
    window: int | None = None, causal_block: int | None = None, window_per_query: bool = False,
) -> torch.Tensor:
    """The maths of `paged_attention` in plain PyTorch (fp32 throughout; syncs on prefix_len)."""
    _check(not window_per_query or window is not None,
           "window_per_query=True needs a window (the window that moves with each query)")
    capacity = min(k_cache.shape[0], page_table.numel()) * k_cache.shape[1]
    prefix = min(int(prefix_len.reshape(-1)[0]), capacity)
    start = max(prefix - (window - 1), 0) if window else 0
    keys = torch.cat([gather_prefix(k_cache, page_table, start, prefix, k_scale),
                      k_new.float()])  # [S, Hkv, D]
    values = torch.cat([gather_prefix(v_cache, page_table, start, prefix, v_scale),
                        v_new.float()])  # [S, Hkv, D]
    group = q.shape[1] // k_new.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * softmax_scale  # [Hq, Tq, S]
    t = torch.arange(q.shape[0], device=q.device)  # [Tq] block positions
    if causal_block:
        hidden = (t[None, :] // causal_block) > (t[:, None] // causal_block)  # [Tq, Tq]
        scores[:, :, prefix - start:] = scores[:, :, prefix - start:].masked_fill(
            hidden, float("-inf"))
    if window_per_query and window:
        key_pos = torch.cat([torch.arange(start, prefix, device=q.device), prefix + t])  # [S]
        early = key_pos[None, :] < (prefix + t)[:, None] - (window - 1)  # [Tq, S]
        scores = scores.masked_fill(early, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hq, Tq, S]
    return torch.einsum("hts,shd->thd", probs, values).to(q.dtype)
