"""`dlmc::split_k_linear`: split-K partials of `x @ W^T` for a block of a few bf16 tokens.

A round multiplies 32 tokens by LLaDA2.1-mini's attention weights (qkv `[3072, 2048]`, o_proj
`[2048, 2048]`, 12.6 and 8.4 MB): 3 and 2 µs at copy speed, 6.2 µs each in cuBLAS in the round (its
64x16 tiles give 64-96 programs that each walk all of K). Here K is split too, as
`dlmc::router_gemm` does: program `(n_tile, split)` multiplies its `BLOCK_N` rows' K range and
writes fp32 partials `[S, T, N]`; whoever consumes the product sums them in a fixed order (s = 0, 1,
...), inside a kernel it runs anyway (Inductor fuses the sum into the residual add and RMSNorm after
o_proj), so there is no extra launch and no atomics (deterministic). The kernel is `router_gemm`'s
with bf16 weights in one tensor-core dot.

The maths is `split_k_linear_reference`: per split, `x.float() @ W.float()^T` (products of bf16
values are exact in fp32; only the order of the fp32 sums differs).
"""

from __future__ import annotations

import torch

from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.router_gemm import (
    check_small_m_operands,
    k_splits,
    launch_split_k,
    split_k_fake,
)

__all__ = ["MAX_TOKENS", "linear_splits", "split_k_linear", "split_k_linear_reference"]

MAX_TOKENS = 64  # one [BLOCK_T, BLOCK_K] tile of tokens per program
# (BLOCK_N, SPLITS, BLOCK_K, num_warps, num_stages)
_CONFIG = (32, 4, 128, 4, 4)


def linear_splits(inner: int) -> tuple[int, int]:
    """(S, K range per split) for a K of `inner` under `_CONFIG`."""
    return k_splits(inner, _CONFIG[1], _CONFIG[2])


def _split_k_linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return launch_split_k(x, weight, _CONFIG, bf16_weight=True)


def _split_k_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return split_k_fake(x, weight, _CONFIG)


_split_k_linear_op = traced_triton_op("dlmc::split_k_linear", _split_k_linear_impl,
                                      _split_k_linear_fake)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Split-K partials of `x @ weight^T` (`dlmc::split_k_linear`).

    x bf16 `[T, K]`, T <= 64, unit stride in the last dim; weight bf16 `[N, K]` contiguous.
    Returns fp32 `[S, T, N]` (S = `linear_splits(K)[0]`) whose sum over S (in fp32) is the
    product; `.sum(0).to(torch.bfloat16)` is `F.linear(x, weight)` up to summation order. Runs
    on CUDA and under `TRITON_INTERPRET=1`; elsewhere `split_k_linear_reference`. No host sync.
    """
    check_small_m_operands("split_k_linear", x, weight, torch.bfloat16, MAX_TOKENS)
    if not (x.is_cuda or _INTERPRETED):
        return split_k_linear_reference(x, weight)
    return _split_k_linear_op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous())


def split_k_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`split_k_linear` in torch ops: `x.float() @ weight.float()^T` over each split's K range,
    `[S, T, N]`."""
    splits, per_split = linear_splits(weight.shape[1])
    xs = x.float().split(per_split, dim=1)
    ws = weight.float().split(per_split, dim=1)
    return torch.stack([xi @ wi.t() for xi, wi in zip(xs, ws, strict=True)])  # [S, T, N]
