"""`dlmc::norm_router_gemm`: the post-attention RMSNorm applied on the way into the MoE router's
split-K GEMM, one launch.

`dlmc::linear_residual` leaves the residual stream `h [T, H]` and each column tile's per-row
`sum(h^2)`. Every program `(n_tile, split)` of this kernel (`dlmc::router_gemm`'s grid and
exact three-way fp32 weight split) sums those tile sums in a fixed order, so
`rstd = rsqrt(sum / H + eps)` per token without reading the whole row, normalises its K range
of `h` as `RMSNorm` does (`w * bf16(h * rstd)`, rounded to bf16), and multiplies that by the
router weight. The programs of the first column tile also store the normalised rows: the
experts and the shared expert read them. So the norm needs no launch of its own.

The maths is `norm_router_gemm_reference`: `rms_norm` with the mean from the tile sums (fp32,
summed in another order than a row reduction), then `router_gemm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import PDL_LAUNCH, device_has_pdl, launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.linear_residual import BLOCK_N as SUM_TILE
from dlmc.custom_ops.nvfp4_tiles import round_bf16
from dlmc.custom_ops.router_gemm import (
    _CONFIG,
    MAX_TOKENS,
    _split_dot,
    check_small_m_operands,
    router_gemm_reference,
    router_splits,
)

__all__ = ["norm_router_gemm", "norm_router_gemm_reference"]


@triton.jit
def _tiles(h_ptr, nw_ptr, w_ptr, t, n, kk, tokens, stride_h, N: tl.constexpr, K: tl.constexpr,
           more):
    """h `[BT, BK]` and the norm weight `[BK]` as fp32, the router weight `[BK, BN]`, of the K
    columns `kk` (nothing loaded unless `more`)."""
    k_ok = (kk < K) & more
    h = tl.load(h_ptr + t[:, None] * stride_h + kk[None, :],
                mask=(t[:, None] < tokens) & k_ok[None, :], other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + kk[:, None],
                mask=(n[None, :] < N) & k_ok[:, None], other=0.0)  # [BK, BN] fp32
    return h, nw, w


@triton.jit
def norm_router_gemm_kernel(h_ptr, ss_ptr, nw_ptr, w_ptr, xn_ptr, part_ptr, tokens, eps,
                            stride_h, N: tl.constexpr, K: tl.constexpr,
                            K_PER_SPLIT: tl.constexpr, TILES: tl.constexpr,
                            BLOCK_TILES: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """part[split, t, n] = sum over split's K range of rms_norm(h)[t, k] * w[n, k]."""
    pdl_enter(PDL)
    n_tile = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    # the first K tile's loads go out before the norm's statistics, which they do not need
    h, nw, w = _tiles(h_ptr, nw_ptr, w_ptr, t, n, kk, tokens, stride_h, N, K, True)
    g = tl.arange(0, BLOCK_TILES)
    sums = tl.load(ss_ptr + g[:, None] * tokens + t[None, :],
                   mask=(g[:, None] < TILES) & (t[None, :] < tokens), other=0.0)
    rstd = tl.math.rsqrt(tl.sum(sums, axis=0) / K + eps)  # [BT]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        normed = round_bf16(h * rstd[:, None], INTERPRETED).to(tl.float32)
        x = round_bf16(normed * nw[None, :], INTERPRETED)  # [BT, BK] bf16
        if n_tile == 0:
            tl.store(xn_ptr + t[:, None] * K + kk[None, :], x,
                     mask=(t[:, None] < tokens) & (kk[None, :] < K))
        acc = _split_dot(acc, x, w, INTERPRETED)
        kk += BLOCK_K  # the next K tile's loads (none after the last)
        h, nw, w = _tiles(h_ptr, nw_ptr, w_ptr, t, n, kk, tokens, stride_h, N, K,
                          k0 + BLOCK_K < K_PER_SPLIT)
    out = part_ptr + (split * tokens + t[:, None]).to(tl.int64) * N + n[None, :]
    tl.store(out, acc, mask=(t[:, None] < tokens) & (n[None, :] < N))


def _outputs(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    splits, _ = router_splits(weight.shape[1])
    return (h.new_empty(h.shape),
            h.new_empty((splits, h.shape[0], weight.shape[0]), dtype=torch.float32))


def _norm_router_gemm_impl(h: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, weight: torch.Tensor, pdl: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    xn, partial = _outputs(h, weight)
    tokens, (experts, inner) = h.shape[0], weight.shape
    if not tokens:
        return xn, partial
    block_n, _, block_k, num_warps, num_stages = _CONFIG
    splits, per_split = router_splits(inner)
    launch = PDL_LAUNCH if pdl and device_has_pdl(h.device) else {}
    launcher(norm_router_gemm_kernel)[(triton.cdiv(experts, block_n), splits)](
        h, sumsq, norm_weight, weight, xn, partial, tokens, eps, h.stride(0), N=experts,
        K=inner, K_PER_SPLIT=per_split, TILES=sumsq.shape[0],
        BLOCK_TILES=triton.next_power_of_2(sumsq.shape[0]),
        BLOCK_T=max(16, triton.next_power_of_2(tokens)), BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=_INTERPRETED, num_warps=num_warps, num_stages=num_stages, **launch)
    return xn, partial


def _norm_router_gemm_fake(h: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, weight: torch.Tensor, pdl: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(h, weight)


_norm_router_gemm_op = traced_triton_op("dlmc::norm_router_gemm", _norm_router_gemm_impl,
                                        _norm_router_gemm_fake, opaque=True)


def norm_router_gemm(h: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, pdl: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(xn, partials)`: `xn = rms_norm(h, norm_weight, eps)` bf16 `[T, H]` with the mean of
    squares from `sumsq` (`dlmc::linear_residual`'s tile sums, fp32 `[ceil(H / 32), T]`), and
    the router's split-K partials of `xn.float() @ weight^T`, fp32 `[S, T, E]`, as
    `dlmc::router_gemm` gives them (`dlmc::norm_router_gemm`).

    h bf16 `[T <= 64, H]`, unit stride in the last dim; norm_weight bf16 `[H]`; weight fp32
    `[E, H]`. `pdl`: launch with programmatic dependent launch where the GPU has it. Runs on
    CUDA and under `TRITON_INTERPRET=1`; elsewhere `norm_router_gemm_reference`. No host sync.
    """
    check_small_m_operands("norm_router_gemm", h, weight, torch.float32, MAX_TOKENS)
    hidden, tiles = h.shape[1], triton.cdiv(h.shape[1], SUM_TILE)
    if sumsq.dtype != torch.float32 or sumsq.shape != (tiles, h.shape[0]):
        raise ValueError(f"norm_router_gemm: sumsq must be fp32 [{tiles}, T={h.shape[0]}] "
                         f"(linear_residual's tile sums), got {sumsq.dtype} "
                         f"{tuple(sumsq.shape)}")
    if norm_weight.dtype != torch.bfloat16 or norm_weight.shape != (hidden,):
        raise ValueError(f"norm_router_gemm: norm_weight must be bf16 [{hidden}], got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    if h.stride(-1) != 1:
        h = h.contiguous()
    if not (h.is_cuda or _INTERPRETED):
        return norm_router_gemm_reference(h, sumsq, norm_weight, eps, weight)
    return _norm_router_gemm_op(h, sumsq.contiguous(), norm_weight.contiguous(), float(eps),
                                weight.contiguous(), pdl)


def norm_router_gemm_reference(h: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor,
                               eps: float, weight: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_router_gemm` in torch ops."""
    rstd = torch.rsqrt(sumsq.sum(0) / h.shape[1] + eps)  # [T]
    xn = norm_weight * (h.float() * rstd[:, None]).to(h.dtype)
    return xn, router_gemm_reference(xn, weight)
