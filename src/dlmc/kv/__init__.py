"""Paged KV cache (FP8 or BF16) and the checkpoint's KV-cache settings."""

from dlmc.kv.paged_cache import KVCacheConfig, PagedKVCache
from dlmc.kv.scales import (
    KV_CACHE_DTYPES,
    KVScales,
    checkpoint_declares_fp8_kv,
    find_kv_scale_names,
    load_kv_scales,
    resolve_kv_cache_dtype,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "KVCacheConfig",
    "KVScales",
    "PagedKVCache",
    "checkpoint_declares_fp8_kv",
    "find_kv_scale_names",
    "load_kv_scales",
    "resolve_kv_cache_dtype",
]
