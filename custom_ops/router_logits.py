"""`dlmc::router_logits`: the MoE router's fp32 GEMM for a few tokens, in one Triton launch.

`logits = x.float() @ weight.t()` with bf16 activations `x [T, H]` and the fp32 router weight
`[E, H]`. Every product is exact in fp32 (a bf16 value times an fp32 one that holds a bf16
checkpoint value) and sums are fp32 FMAs (`input_precision="ieee"`, no TF32), so the result
differs from torch's fp32 GEMM only in summation order. For this shape (`[32, 2048] x
[2048, 256]`) the compiled round ran a cuBLAS SIMT sgemm (6.7 µs) and an fp32 conversion kernel
(2.4 µs) per MoE layer on the H200 (perf/README.md). Here each program tiles `[32 tokens, 16
experts]`, reads `x` in bf16 and streams its slice of the weight once. Opt-in until measured
on a GPU: `DLMC_ROUTER_GEMM=triton` (the Router's switch).
The maths is `router_logits_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op

__all__ = ["router_logits", "router_logits_reference"]

BLOCK_T, BLOCK_E, BLOCK_K = 32, 16, 128


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, tokens, stride_x, stride_w, stride_o,
                          E: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + k
        x = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :],
                    mask=(t[:, None] < tokens) & (kk[None, :] < H), other=0.0)  # [BT, BK]
        w = tl.load(w_ptr + e[None, :] * stride_w + kk[:, None],
                    mask=(e[None, :] < E) & (kk[:, None] < H), other=0.0)  # [BK, BE]
        acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(out_ptr + t[:, None] * stride_o + e[None, :], acc,
             mask=(t[:, None] < tokens) & (e[None, :] < E))


def _router_logits_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(experts, BLOCK_E))
        wrap_triton(_router_logits_kernel)[grid](
            x, weight, out, tokens, x.stride(0), weight.stride(0), out.stride(0), E=experts,
            H=hidden, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, num_warps=4,
            num_stages=3)
    return out


def _router_logits_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


_router_logits_op = traced_triton_op("dlmc::router_logits", _router_logits_impl,
                                     _router_logits_fake)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits `x.float() @ weight.t()` (Triton, `dlmc::router_logits`).

    x bf16 `[T, H]` with unit stride in the last dim; weight fp32 `[E, H]` contiguous. Returns
    fp32 `[T, E]`: exact products, fp32 sums (order differs from torch's GEMM). Runs on CUDA and
    under `TRITON_INTERPRET=1`; elsewhere `router_logits_reference`. No host sync.
    """
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"router_logits: x must be bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_logits: weight must be fp32 [E, H={x.shape[1]}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if not (x.is_cuda or _INTERPRETED):
        return router_logits_reference(x, weight)
    return _router_logits_op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous())


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x.float() @ weight.float().t()`: the LLaDA2 router's logits in fp32."""
    return x.float() @ weight.float().t()
