"""`dlmc::router_gemm`: the MoE router's fp32 `x.float() @ W^T` on BF16 tensor cores, split-K.

The router multiplies a block of bf16 tokens by an fp32 weight (LLaDA2.1-mini: `[32, 2048] x
[2048, 256]`, 2 MB). cuBLAS runs it as a SIMT sgemm plus a split-K reduction, about twice this
kernel's time with the routing (docs/nvfp4.md, "Why this default"). It is latency bound, so
this kernel (a) spreads the weight over ~256 programs by splitting K and (b) uses BF16 tensor
cores exactly:

- each fp32 weight is split in registers into three bf16 parts, `hi = bf16(w)`,
  `mid = bf16(w - hi)`, `lo = bf16(w - hi - mid)` (round to nearest even), and
  `dot(x, hi) + dot(x, mid) + dot(x, lo)` accumulates in fp32. x holds bf16 values, so every
  product is exact; only the order (and the tensor core's rounding) of the fp32 sums differs
  from `x.float() @ W^T`.
- Why the split is exact: for a normal w with exponent e, `w - hi` is a multiple of 2^(e-23) of
  magnitude <= 2^(e-8) (16 significant bits, exactly representable); `mid` takes its top 8 and
  leaves <= 8 significant bits, which `lo` holds exactly. Edge cases: for |w| < 2^-103 (~1e-31)
  a part can fall below bf16's smallest normal 2^-126 and be flushed to zero or rounded to the
  subnormal grid (Triton's interpreter flushes; tests/custom_ops/test_router_gemm.py checks the
  GPU): absolute error < 2^-124 |x| per product, far below any logit's fp32 rounding. |w| at or
  above 2^128 - 2^119 (bf16's overflow threshold) rounds `hi` to inf; inf/nan weights are not
  expected in a router and are not preserved.
- Program `(n_tile, split)` writes its `[T, BLOCK_N]` share of the K range `split` to the
  partial `[S, T, N]` fp32; no atomics, so results are deterministic. `dlmc::moe_route` sums
  the S partials in a fixed order (s = 0, 1, ...), so the router needs no extra reduce kernel.

The maths is `router_gemm_reference` (the fp32 GEMM split along K the same way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["MAX_TOKENS", "check_small_m_operands", "k_splits", "launch_split_k", "router_gemm",
           "router_gemm_reference", "router_splits", "split_k_fake", "split_k_partial"]

MAX_TOKENS = 64  # one [BLOCK_T, BLOCK_K] tile of tokens per program
# (BLOCK_N, SPLITS, BLOCK_K, num_warps, num_stages): 256 experts in 16 N tiles x 16 K splits =
# 256 programs on LLaDA2.1-mini (K range 128 each), faster than 8 splits on an H200.
_CONFIG = (16, 16, 128, 4, 2)


@triton.jit
def _split_dot(acc, x, w, INTERPRETED: tl.constexpr):
    """acc + x @ w, x bf16 `[BT, BK]`, w fp32 `[BK, BN]`, as three exact BF16 dots."""
    hi = round_bf16(w, INTERPRETED)
    rest = w - hi.to(tl.float32)  # exact
    mid = round_bf16(rest, INTERPRETED)
    lo = round_bf16(rest - mid.to(tl.float32), INTERPRETED)  # exact for |w| >= 2^-110
    if INTERPRETED:  # the interpreter's bf16 dot is wrong: widen (the products stay exact)
        xf = x.to(tl.float32)
        acc = tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, hi, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, lo, acc)
    return acc


@triton.jit
def split_k_partial(x_ptr, w_ptr, tokens, stride_x, t, n, split, N: tl.constexpr,
                    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                    BF16_WEIGHT: tl.constexpr):
    """fp32 `[BLOCK_T, BLOCK_N]`: sum over k in split's K range of x[t, k] * w[n, k], fp32 w
    through the exact three-way split or (`BF16_WEIGHT`) bf16 w in one dot."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kk = k_start + k0 + k
        x = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :],
                    mask=(t[:, None] < tokens) & (kk[None, :] < K), other=0.0)  # [BT, BK]
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(n[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
        if not BF16_WEIGHT:
            acc = _split_dot(acc, x, w, INTERPRETED)
        elif INTERPRETED:  # the interpreter's bf16 dot is wrong: widen (exact products)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def router_gemm_kernel(x_ptr, w_ptr, part_ptr, tokens, stride_x, N: tl.constexpr,
                       K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
                       BF16_WEIGHT: tl.constexpr = False):
    """part[split, t, n] = `split_k_partial` of program (n_tile, split): fp32 w, or
    (`BF16_WEIGHT`, `dlmc::split_k_linear`) bf16 w."""
    pdl_enter(PDL)
    split = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = split_k_partial(x_ptr, w_ptr, tokens, stride_x, t, n, split, N, K, K_PER_SPLIT,
                          BLOCK_T, BLOCK_N, BLOCK_K, INTERPRETED, BF16_WEIGHT)
    out = part_ptr + (split * tokens + t[:, None]).to(tl.int64) * N + n[None, :]
    tl.store(out, acc, mask=(t[:, None] < tokens) & (n[None, :] < N))


def k_splits(inner: int, splits: int, block_k: int) -> tuple[int, int]:
    """(S, K range per split) for a K of `inner` in at most `splits` splits: the range is a
    multiple of `block_k` and no split is empty."""
    per_split = triton.cdiv(triton.cdiv(inner, splits), block_k) * block_k
    return triton.cdiv(inner, per_split), per_split


def router_splits(inner: int) -> tuple[int, int]:
    """`k_splits` under `_CONFIG`."""
    return k_splits(inner, _CONFIG[1], _CONFIG[2])


def launch_split_k(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...],
                   bf16_weight: bool) -> torch.Tensor:
    """The partials `[S, T, N]` fp32 of `x @ weight^T` under `config` (BLOCK_N, SPLITS,
    BLOCK_K, num_warps, num_stages), fp32 or (`bf16_weight`) bf16 weights: the body of this op
    and of `dlmc::split_k_linear`."""
    tokens, (features, inner) = x.shape[0], weight.shape
    block_n, splits, block_k, num_warps, num_stages = config
    splits, per_split = k_splits(inner, splits, block_k)
    partial = torch.empty((splits, tokens, features), dtype=torch.float32, device=x.device)
    if not tokens:
        return partial
    launcher(router_gemm_kernel)[(triton.cdiv(features, block_n), splits)](
        x, weight, partial, tokens, x.stride(0), N=features, K=inner, K_PER_SPLIT=per_split,
        BLOCK_T=max(16, triton.next_power_of_2(tokens)), BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=_INTERPRETED, BF16_WEIGHT=bf16_weight, num_warps=num_warps,
        num_stages=num_stages)
    return partial


def split_k_fake(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    """Fake of `launch_split_k`: the partials' shape under `config`."""
    splits, _ = k_splits(weight.shape[1], config[1], config[2])
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)


def _router_gemm_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return launch_split_k(x, weight, _CONFIG, bf16_weight=False)


def _router_gemm_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return split_k_fake(x, weight, _CONFIG)


_router_gemm_op = traced_triton_op("dlmc::router_gemm", _router_gemm_impl, _router_gemm_fake)


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Split-K partials of the router logits `x.float() @ weight^T` (`dlmc::router_gemm`).

    x bf16 `[T, K]`, T <= 64, unit stride in the last dim; weight fp32 `[N, K]` contiguous.
    Returns fp32 `[S, T, N]` (S = `router_splits(K)[0]`, 16 K splits by default) whose sum over S
    is the logits, as `dlmc::moe_route` takes them. BF16 tensor cores on an exact three-way
    split of the weight; see the module docstring for the (tiny) exceptions. Runs on CUDA and
    under `TRITON_INTERPRET=1`; elsewhere `router_gemm_reference`. No host sync.
    """
    check_small_m_operands("router_gemm", x, weight, torch.float32, MAX_TOKENS)
    if not (x.is_cuda or _INTERPRETED):
        return router_gemm_reference(x, weight)
    return _router_gemm_op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous())


def router_gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`router_gemm` in torch ops: `x.float() @ weight^T` over each split's K range, `[S, T, N]`."""
    splits, per_split = router_splits(weight.shape[1])
    xs = x.float().split(per_split, dim=1)
    ws = weight.float().split(per_split, dim=1)
    return torch.stack([xi @ wi.t() for xi, wi in zip(xs, ws, strict=True)])  # [S, T, N]


def check_small_m_operands(op: str, x: torch.Tensor, weight: torch.Tensor,
                           weight_dtype: torch.dtype, max_tokens: int) -> None:
    """x bf16 `[T <= max_tokens, K]`, weight `weight_dtype` `[N, K]`; else a ValueError naming
    `op`, the tensor and what was expected."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] > max_tokens:
        raise ValueError(f"{op}: x must be bf16 [T <= {max_tokens}, K], got "
                         f"{x.dtype} {tuple(x.shape)}")
    if weight.dtype != weight_dtype or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(weight_dtype, weight_dtype)
        raise ValueError(f"{op}: weight must be {name} [N, K={x.shape[1]}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
