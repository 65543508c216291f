"""`dlmc::moe_combine`: the weighted sum of each token's expert outputs, one Triton kernel.

The grouped MoE kernels (`dlmc::nvfp4_moe`, `dlmc::bf16_moe`) write one bf16 row per (token, k)
pair, `y[t*P + k]` with `P = K` (or `K+1` with a shared expert, whose row `t*P + K` has weight
1.0). The combine is `out[t] = bf16(sum_k w[t, k] * float(y[t*P + k]))`, summed in fp32 in pair
order. Inductor's reduction for the torch form of this sum varies between compiles, so it is a
hand-written kernel with a fixed launch: one program per token and `BLOCK_H` columns, the `P`
rows read coalesced along H.
`combine_pairs` launches it inside the bodies of the MoE ops; `moe_combine` is the same kernel
as a registered op. The maths is `moe_combine_reference`.

Where a round is compiled, `NVFP4Experts` takes `nvfp4_moe`'s pair rows instead and sums them
with `combine_pointwise`, pointwise torch ops that Inductor fuses into the residual add and
RMSNorm after the MoE block: no combine launch (docs/nvfp4.md, "Why this default"). Eager calls
and the MoE ops' own bodies (BF16 experts too) run the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import PDL_LAUNCH, launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_align import append_shared_column
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["combine_pairs", "combine_pointwise", "moe_combine", "moe_combine_reference"]

MAX_BLOCK_H = 1024  # columns per program
NUM_WARPS = 4


@triton.jit
def moe_combine_kernel(y_ptr, w_ptr, out_ptr, hidden, stride_y, stride_wt, stride_wk,
                       stride_out, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                       BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, cols] = bf16(sum_k w[t, k] * y[t*P + k, cols]) (+ y[t*P + K, cols] if SHARED), in
    fp32 in pair order; program (t, column block)."""
    pdl_enter(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    mask = cols < hidden
    row = token.to(tl.int64) * (TOP_K + SHARED)  # the token's first pair row
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        weight = tl.load(w_ptr + token.to(tl.int64) * stride_wt + k * stride_wk)  # fp32 scalar
        y = tl.load(y_ptr + (row + k) * stride_y + cols, mask=mask, other=0.0)  # [BH] bf16
        acc += weight * y.to(tl.float32)
    if SHARED:  # the shared expert's row, weight 1.0
        y = tl.load(y_ptr + (row + TOP_K) * stride_y + cols, mask=mask, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, round_bf16(acc, INTERPRETED),
             mask=mask)


def combine_pairs(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                  shared_expert: bool = False, pdl: bool = False) -> torch.Tensor:
    """Launch `moe_combine_kernel`: `out[t] = sum_k w[t, k] * y[t*P + k]` in fp32, cast to bf16.

    y bf16 `[T*P, H]` with unit stride along H (P = K, or K+1 with `shared_expert`: the last row
    of each token is the shared expert's, weight 1.0); topk_weights fp32 `[T, K]`; out bf16
    `[T, H]` with unit stride along H, written and returned. Unchecked (the callers' bodies
    check); callable inside traced Triton ops (`_pdl.launcher`). T == 0 launches nothing.
    `pdl` (the body of an opaque op on sm_90+ only): the kernel launches with programmatic
    dependent launch.
    """
    return _launch(y, topk_weights, out, shared_expert,
                   PDL_LAUNCH if pdl and not _INTERPRETED else {})


def _launch(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
            shared_expert: bool, launch: dict[str, bool] | None = None) -> torch.Tensor:
    tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    if tokens == 0 or hidden == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden), MAX_BLOCK_H)
    launcher(moe_combine_kernel)[(tokens, triton.cdiv(hidden, block_h))](
        y, topk_weights, out, hidden, y.stride(0), topk_weights.stride(0),
        topk_weights.stride(1), out.stride(0), TOP_K=top_k, SHARED=bool(shared_expert),
        BLOCK_H=block_h, INTERPRETED=_INTERPRETED, num_warps=NUM_WARPS, **(launch or {}))
    return out


def _moe_combine_impl(y: torch.Tensor, topk_weights: torch.Tensor,
                      shared_expert: bool = False) -> torch.Tensor:
    out = torch.empty((topk_weights.shape[0], y.shape[1]), dtype=torch.bfloat16,
                      device=y.device)
    return _launch(y, topk_weights, out, shared_expert)


def _moe_combine_fake(y: torch.Tensor, topk_weights: torch.Tensor,
                      shared_expert: bool = False) -> torch.Tensor:
    return y.new_empty((topk_weights.shape[0], y.shape[1]), dtype=torch.bfloat16)


# Inductor traces through the body (one allocation + the kernel); opaque when interpreted.
_moe_combine_op = traced_triton_op("dlmc::moe_combine", _moe_combine_impl, _moe_combine_fake)


def _check(y: torch.Tensor, topk_weights: torch.Tensor, shared_expert: bool) -> None:
    if topk_weights.dim() != 2 or topk_weights.dtype != torch.float32:
        raise ValueError(f"moe_combine: topk_weights must be fp32 [T, K], got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    tokens, top_k = topk_weights.shape
    rows = tokens * (top_k + int(shared_expert))
    if y.dim() != 2 or y.dtype != torch.bfloat16 or y.shape[0] != rows:
        pairs = f"K+1={top_k + 1}" if shared_expert else f"K={top_k}"
        raise ValueError(f"moe_combine: y must be bf16 [T*P={rows}, H] (T={tokens}, P={pairs}), "
                         f"got {y.dtype} {tuple(y.shape)}")
    if not y.is_contiguous():
        raise ValueError(f"moe_combine: y must be contiguous, got strides {y.stride()}")
    if y.device != topk_weights.device:
        raise ValueError(f"moe_combine: y and topk_weights must be on the same device, got "
                         f"{y.device} and {topk_weights.device}")


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor,
                shared_expert: bool = False) -> torch.Tensor:
    """Weighted sum of each token's expert outputs (`dlmc::moe_combine`).

    y bf16 `[T*P, H]` contiguous: row `t*P + k` is pair (t, k)'s expert output, with `P = K`, or
    `P = K+1` when `shared_expert` (row `t*P + K` is the shared expert's, weight 1.0);
    topk_weights fp32 `[T, K]` on y's device. Returns bf16 `[T, H]`,
    `out[t] = bf16(sum_k w[t, k] * float(y[t*P + k]))` summed in fp32 in pair order (rounded to
    nearest even). Runs on CUDA and under `TRITON_INTERPRET=1`; elsewhere
    `moe_combine_reference`. No host sync (graph-capturable).
    """
    _check(y, topk_weights, shared_expert)
    if not (y.is_cuda or _INTERPRETED):
        return moe_combine_reference(y, topk_weights, shared_expert)
    return _moe_combine_op(y, topk_weights, shared_expert)


def moe_combine_reference(y: torch.Tensor, topk_weights: torch.Tensor,
                          shared_expert: bool = False) -> torch.Tensor:
    """`moe_combine` in torch ops: `(y.view(T, P, H).float() * w[..., None]).sum(1)` -> bf16."""
    if shared_expert:
        topk_weights = append_shared_column(topk_weights, 1.0)  # [T, K+1]
    tokens, pairs = topk_weights.shape
    rows = y.view(tokens, pairs, y.shape[1]).float()  # [T, P, H]
    products = rows * topk_weights.float()[..., None]  # [T, P, H]
    return products.sum(dim=1).to(torch.bfloat16)  # [T, H]


def combine_pointwise(y: torch.Tensor, topk_weights: torch.Tensor,
                      shared_expert: bool = False) -> torch.Tensor:
    """`moe_combine`'s sum as one pointwise expression (no reduction): `w[t, 0] * y[t, 0]`, plus
    each next pair in pair order, plus the shared expert's row, in fp32, then bf16, the order
    of the kernel's loop. Inductor fuses such an expression into the kernel that consumes it
    (where a round is compiled). Shapes as in `moe_combine`; K >= 1."""
    tokens, top_k = topk_weights.shape
    rows = y.view(tokens, top_k + int(shared_expert), y.shape[1])  # [T, P, H]
    weights = topk_weights.float()
    acc = weights[:, 0:1] * rows[:, 0].float()  # [T, H]
    for k in range(1, top_k):
        acc = acc + weights[:, k:k + 1] * rows[:, k].float()
    if shared_expert:
        acc = acc + rows[:, top_k].float()
    return acc.to(torch.bfloat16)
