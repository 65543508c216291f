"""Random inputs and the reference comparison shared by the paged-attention tests."""

from __future__ import annotations

import math

import torch

from dlmc.custom_ops.kv_append import quantize_kv_reference
from dlmc.custom_ops.paged_attention import (
    PagedAttentionVariant,
    launch_paged_attention,
    paged_attention,
    paged_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def make_case(
    *, num_queries: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    prefix: int, k_scale: float = 1.0, v_scale: float = 1.0, dtype: torch.dtype = FP8,
    spare_pages: int = 2, seed: int = 0, device: str = DEVICE,
) -> dict[str, torch.Tensor]:
    """Random inputs: the cache holds quantized random K/V (|x| spread over 1e-3..10)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = math.ceil(max(prefix, 1) / page_size) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)

    def rand(*size: int) -> torch.Tensor:
        magnitude = torch.exp(torch.empty(size).uniform_(-7, 2.3, generator=gen))
        return torch.randn(size, generator=gen) * magnitude

    k_scale_t = torch.tensor([k_scale], dtype=torch.float32)
    v_scale_t = torch.tensor([v_scale], dtype=torch.float32)
    case = {
        "q": torch.randn(num_queries, num_q_heads, head_dim, generator=gen).bfloat16(),
        "k_new": torch.randn(num_queries, num_kv_heads, head_dim, generator=gen).bfloat16(),
        "v_new": torch.randn(num_queries, num_kv_heads, head_dim, generator=gen).bfloat16(),
        "k_cache": quantize_kv_reference(rand(*shape), k_scale_t, dtype),
        "v_cache": quantize_kv_reference(rand(*shape), v_scale_t, dtype),
        "page_table": torch.randperm(num_pages, generator=gen).to(torch.int32),
        "prefix_len": torch.tensor([prefix], dtype=torch.int32),
        "k_scale": k_scale_t,
        "v_scale": v_scale_t,
    }
    return {name: t.to(device) for name, t in case.items()}


def assert_matches_reference(case: dict[str, torch.Tensor],
                             variant: PagedAttentionVariant | None = None,
                             **options: object) -> None:
    """The op (or, given a variant, its kernels launched with it) against the reference."""
    num_splits = options.pop("num_splits", None)
    if variant is None:
        out = paged_attention(**case, **options, num_splits=num_splits)
    else:
        out = launch_paged_attention(
            *case.values(), float(options["softmax_scale"]), options.get("window") or 0,
            options.get("causal_block") or 0, num_splits or 0, variant,
            window_per_query=bool(options.get("window_per_query", False)))
    ref = paged_attention_reference(**case, **options)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    bound = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=0.02 * bound + 1e-6, rtol=0.02)
