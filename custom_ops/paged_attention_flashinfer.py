"""Optional FlashInfer backend: FA2 paged prefill with BF16 queries and an FP8 (or BF16) cache.

FlashInfer plans on the host (`plan()` copies the page metadata and picks the work split), then
`run()` launches on the device. Inside CUDA graphs: construct with fixed-size metadata buffers
(`use_cuda_graph=True`), call `plan()` OUTSIDE capture before every replay, and capture `run()`.
`disable_split_kv=True` keeps the grid independent of the KV length (docs/nvfp4.md §4.2).

The block's own K/V must be in the cache (FlashInfer attends only the cache): the caller appends
them after the prefix first (`PagedKVCache.attend` does), so here they are FP8-rounded, unlike
the Triton op, which keeps them in BF16. Scales are host floats: FlashInfer folds `k_scale`
into the softmax scale and multiplies the output by `v_scale`.

Install on the H200 (no network there): download `flashinfer-python==0.5.3`,
`apache-tvm-ffi<0.2` and `nvidia-cudnn-frontend` wheels, `pip install --no-deps` them; the first
`plan()+run()` per (dtype, head dim) JIT-compiles with nvcc (about 18 s with `MAX_JOBS=16
FLASHINFER_CUDA_ARCH_LIST=9.0a`). Warm it before capture (docs/paged_attention.md).
"""

from __future__ import annotations

import torch

from dlmc.errors import ConfigError

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FA2 on sm_90; 512 is not enabled there (docs/nvfp4.md §4.2)
WORKSPACE_BYTES = 128 * 1024 * 1024


def flashinfer_available() -> bool:
    """True when `flashinfer` imports (it JIT-compiles its kernels on first use)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferPagedAttention:
    """One sequence, `Tq` block queries over `kv_len` cached tokens, via FlashInfer's FA2 prefill.

    Args:
        num_q_heads, num_kv_heads, head_dim, page_size: shapes (head_dim in 64/128/256).
        max_pages: page-table capacity (size of the fixed indices buffer).
        kv_dtype: cache dtype, torch.float8_e4m3fn or torch.bfloat16.
    """

    def __init__(
        self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
        max_pages: int, kv_dtype: torch.dtype, device: torch.device,
    ) -> None:
        try:
            import flashinfer
        except ImportError as err:
            raise ConfigError(
                "attention backend='flashinfer' needs the flashinfer-python package (0.5.3; see "
                "README, 'FlashInfer'); install it or choose backend='triton'") from err
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(
                f"attention backend='flashinfer' does not support head_dim={head_dim} on this GPU "
                f"(FA2 supports {SUPPORTED_HEAD_DIMS}); choose backend='triton'")
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.page_size, self.kv_dtype = head_dim, page_size, kv_dtype
        self.device = torch.device(device)
        int32 = {"dtype": torch.int32, "device": self.device}
        self._qo_indptr = torch.zeros(2, **int32)
        self._kv_indptr = torch.zeros(2, **int32)
        self._kv_indices = torch.zeros(max_pages, **int32)
        self._last_page_len = torch.zeros(1, **int32)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self._qo_indptr,
            paged_kv_indptr_buf=self._kv_indptr, paged_kv_indices_buf=self._kv_indices,
            paged_kv_last_page_len_buf=self._last_page_len, backend="fa2")

    def plan(self, kv_len: int, num_queries: int, page_table: torch.Tensor,
             softmax_scale: float) -> None:
        """Host-side planning: `num_queries` rows over `kv_len` cached tokens (block included).

        Not capturable: call before every replay; `num_queries` must stay fixed per graph.
        """
        num_pages = max(1, -(-kv_len // self.page_size))
        last_page_len = kv_len - (num_pages - 1) * self.page_size
        self._wrapper.plan(
            torch.tensor([0, num_queries], dtype=torch.int32),
            torch.tensor([0, num_pages], dtype=torch.int32),
            page_table[:num_pages],
            torch.tensor([last_page_len], dtype=torch.int32),
            self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=False, sm_scale=softmax_scale, q_data_type=torch.bfloat16,
            kv_data_type=self.kv_dtype, disable_split_kv=True)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            k_scale: float, v_scale: float) -> torch.Tensor:
        """q `[Tq, Hq, D]` bf16 over caches `[num_pages, page_size, Hkv, D]` → `[Tq, Hq, D]`."""
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        return self._wrapper.run(q, (k_cache, v_cache), k_scale=k_scale if fp8 else None,
                                 v_scale=v_scale if fp8 else None)
