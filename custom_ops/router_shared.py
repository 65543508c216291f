"""`dlmc::router_gemm_shared`: `dlmc::router_gemm` and the BF16 shared expert's gate/up in one
launch (`DLMC_NVFP4_SHARED=router`).

The router GEMM is latency bound (~4.4 µs per LLaDA2.1-mini layer on the H200 for 2 MB), and
so is the shared expert inside `dlmc::nvfp4_moe` (its parts keep the op on the Triton gate/up
kernel: 93-95 against 88-90 µs per layer routed-only, perf/README.md sessions 27-29). Here the
shared expert's gate/up parts (`moe_shared_parts.shared_gate_up_part`, the op's device
function and tiles, `nvfp4_moe.shared_part_tiles`) run as extra programs of the router's
launch, which needs only x too: `h[t] = bf16(bf16(silu(g)) * u)`, `g`, `u` the bf16-rounded
projections, bit for bit the op's shared h rows. `dlmc::moe_route_shared` then runs the down
parts. The maths is `router_gemm_shared_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dlmc.custom_ops import router_gemm as _router
from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_shared_parts import shared_gate_up_part, shared_parts, shared_split
from dlmc.custom_ops.nvfp4_moe import shared_part_tiles
from dlmc.custom_ops.router_gemm import router_gemm_program  # by name: Inductor's kernel source
from dlmc.custom_ops.small_m_linear import check_small_m_operands

__all__ = ["router_gemm_shared", "router_gemm_shared_reference"]

SHARED_BLOCK_M = 16  # tokens per part (rows are independent: any size gives the same bits)


@triton.jit
def router_shared_kernel(x_ptr, w_ptr, part_ptr, gate_w, up_w, h_ptr, tokens, stride_x,
                         stride_h, N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, I: tl.constexpr, PARTS: tl.constexpr,
                         SH_BLOCK_M: tl.constexpr, SH_BLOCK_N: tl.constexpr,
                         SH_SPLIT: tl.constexpr, SH_BLOCK_K: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """Programs (N-tile, split < SPLITS): the router GEMM's partials; the rows after them,
    numbered along N-tiles first: the shared expert's gate/up parts (PARTS per I-tile)."""
    row = tl.program_id(1)
    if row < SPLITS:
        router_gemm_program(x_ptr, w_ptr, part_ptr, tokens, stride_x, row, tl.program_id(0), N,
                            K, K_PER_SPLIT, BLOCK_T, BLOCK_N, BLOCK_K, INTERPRETED)
    else:
        q = (row - SPLITS) * tl.num_programs(0) + tl.program_id(0)
        if q < PARTS * tl.cdiv(I, SH_BLOCK_N):
            shared_gate_up_part(x_ptr, gate_w, up_w, h_ptr, q % PARTS, q // PARTS, tokens, 1, 1,
                                0, K, I, stride_x, stride_h, SH_BLOCK_M, SH_BLOCK_N, SH_SPLIT,
                                SH_BLOCK_K, INTERPRETED)


def _impl(x: torch.Tensor, weight: torch.Tensor, shared_gate: torch.Tensor,
          shared_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, (features, inner), inter = x.shape[0], weight.shape, shared_gate.shape[0]
    block_n, splits, block_k, num_warps, num_stages = _router._CONFIG
    splits, per_split = _router.k_splits(inner, splits, block_k)
    partial = torch.empty((splits, tokens, features), dtype=torch.float32, device=x.device)
    h = torch.empty((tokens, inter), dtype=torch.bfloat16, device=x.device)
    if not tokens:
        return partial, h
    sh_block_n, sh_block_k = shared_part_tiles(inner, inter)["gate_up"]
    parts = shared_parts(tokens, SHARED_BLOCK_M, sh_block_n)
    tiles = triton.cdiv(features, block_n)
    extra = triton.cdiv(parts * triton.cdiv(inter, sh_block_n), tiles)
    launcher(router_shared_kernel)[(tiles, splits + extra)](
        x, weight, partial, shared_gate, shared_up, h, tokens, x.stride(0), h.stride(0),
        N=features, K=inner, K_PER_SPLIT=per_split, SPLITS=splits,
        BLOCK_T=max(16, triton.next_power_of_2(tokens)), BLOCK_N=block_n, BLOCK_K=block_k,
        I=inter, PARTS=parts, SH_BLOCK_M=SHARED_BLOCK_M, SH_BLOCK_N=sh_block_n,
        SH_SPLIT=shared_split(sh_block_n), SH_BLOCK_K=sh_block_k, INTERPRETED=_INTERPRETED,
        num_warps=num_warps, num_stages=num_stages)
    return partial, h


def _fake(x: torch.Tensor, weight: torch.Tensor, shared_gate: torch.Tensor,
          shared_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (_router.split_k_fake(x, weight, _router._CONFIG),
            x.new_empty((x.shape[0], shared_gate.shape[0]), dtype=torch.bfloat16))


_op = traced_triton_op("dlmc::router_gemm_shared", _impl, _fake)


def _check_weights(hidden: int, inter: int, **weights: torch.Tensor) -> None:
    """The shared gate/up weights: contiguous bf16 `[I, H]` (errors name the tensor)."""
    for name, w in weights.items():
        shape = (inter, hidden)
        if w.dtype != torch.bfloat16 or tuple(w.shape) != shape or not w.is_contiguous():
            raise ValueError(f"router_gemm_shared: shared_{name} must be contiguous bf16 "
                             f"{list(shape)} (H={hidden}, I={inter}), got {w.dtype} "
                             f"{tuple(w.shape)}")


def router_gemm_shared(x: torch.Tensor, weight: torch.Tensor, shared_gate: torch.Tensor,
                       shared_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_gemm`'s split-K partials and the shared expert's h, one launch
    (`dlmc::router_gemm_shared`).

    x bf16 `[T, H]` (T <= 64, unit stride in the last dim), weight fp32 `[E, H]` contiguous,
    shared_gate / shared_up bf16 `[I, H]` contiguous. Returns (fp32 `[S, T, E]` as
    `router_gemm`, bf16 `[T, I]` `bf16(bf16(silu(bf16(x @ gate^T))) * bf16(x @ up^T))`). Runs on
    CUDA and under `TRITON_INTERPRET=1`; elsewhere `router_gemm_shared_reference`. No host sync.
    """
    check_small_m_operands("router_gemm_shared", x, weight, torch.float32, _router.MAX_TOKENS)
    _check_weights(x.shape[1], shared_gate.shape[0], gate=shared_gate, up=shared_up)
    if not (x.is_cuda or _INTERPRETED):
        return router_gemm_shared_reference(x, weight, shared_gate, shared_up)
    return _op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous(), shared_gate,
               shared_up)


def router_gemm_shared_reference(x: torch.Tensor, weight: torch.Tensor,
                                 shared_gate: torch.Tensor, shared_up: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_gemm_shared` in torch ops: `router_gemm_reference` and `SwiGLUMLP`'s bf16 h."""
    h = F.silu(F.linear(x, shared_gate)) * F.linear(x, shared_up)  # bf16 ops, as SwiGLUMLP
    return _router.router_gemm_reference(x, weight), h
