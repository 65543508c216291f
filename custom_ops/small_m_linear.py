"""`dlmc::small_m_linear`: `x @ W^T` for a block of a few bf16 tokens (Triton).

A denoising round multiplies 32 (or 64) tokens by each attention / dense-MLP weight. The bytes
are the weight's (12.6 MB for LLaDA2.1-mini's qkv, 3 µs at copy speed), yet cuBLAS took 5.2–6.5
µs per such GEMM in the H200 profiles (perf/README.md). Here each program owns `BLOCK_N` output
features for all tokens and streams its weight rows once, so the grid spreads a weight over
~100 SMs: tensor-core dots, fp32 accumulation, one rounding to a bf16 result.
Opt-in (`DLMC_SMALL_M_GEMM=triton`, `dlmc.models.layers.linear`): measured slower than cuBLAS
on the H200 except for o_proj (perf/README.md, session 11). The MoE router's fp32 GEMM is
`dlmc::router_gemm`.
The maths is `small_m_linear_reference` (results differ only in summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["MAX_TOKENS", "small_m_linear", "small_m_linear_reference"]

MAX_TOKENS = 64  # more rows: cuBLAS's tiles are the right tool
# (BLOCK_N output features per program, BLOCK_K, num_warps, num_stages);
# perf/bench_small_m_linear.py sweeps `_CONFIG`.
_CONFIG = (16, 256, 4, 4)


@triton.jit
def _small_m_linear_kernel(x_ptr, w_ptr, y_ptr, tokens, stride_x, stride_y, N: tl.constexpr,
                           K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.arange(0, BLOCK_T)  # all tokens in one tile
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        x = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :],
                    mask=(t[:, None] < tokens) & (kk[None, :] < K), other=0.0)  # [BT, BK]
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(n[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
        if INTERPRETED:  # the interpreter's bf16 dot is wrong: widen (exact products)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + t[:, None] * stride_y + n[None, :], round_bf16(acc, INTERPRETED),
             mask=(t[:, None] < tokens) & (n[None, :] < N))


def _small_m_linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    tokens, features = x.shape[0], weight.shape[0]
    y = torch.empty((tokens, features), dtype=weight.dtype, device=x.device)
    if not tokens:
        return y
    block_n, block_k, num_warps, num_stages = _CONFIG
    launcher(_small_m_linear_kernel)[(triton.cdiv(features, block_n),)](
        x, weight, y, tokens, x.stride(0), y.stride(0), N=features, K=weight.shape[1],
        BLOCK_T=max(16, triton.next_power_of_2(tokens)), BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=_INTERPRETED, num_warps=num_warps, num_stages=num_stages)
    return y


def _small_m_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=weight.dtype)


_small_m_linear_op = traced_triton_op("dlmc::small_m_linear", _small_m_linear_impl,
                                      _small_m_linear_fake)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` for at most `MAX_TOKENS` tokens (Triton, `dlmc::small_m_linear`).

    x bf16 `[T, K]` with unit stride in the last dim, T <= 64; weight bf16 `[N, K]` contiguous.
    Returns bf16 `[T, N]` (fp32 accumulation, one rounding). Runs on CUDA and under
    `TRITON_INTERPRET=1`; elsewhere `small_m_linear_reference`.
    No host sync.
    """
    check_small_m_operands("small_m_linear", x, weight, torch.bfloat16, MAX_TOKENS)
    if not (x.is_cuda or _INTERPRETED):
        return small_m_linear_reference(x, weight)
    return _small_m_linear_op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous())


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


def small_m_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (bf16)."""
    return F.linear(x, weight)
