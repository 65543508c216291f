"""`dlmc::moe_route_shared`: `dlmc::moe_route` and the BF16 shared expert's down projection in
one launch (`DLMC_NVFP4_SHARED=router`).

After `dlmc::router_gemm_shared` (the router's partials and the shared expert's h rows) this
launch routes the tokens (`moe_route.route_tokens`, one program per token) and runs the shared
expert's down parts (`moe_shared_parts.shared_down_part`, the op's device function and tiles)
as extra programs: `y[t] = bf16(h[t] @ down^T)`, bit for bit the op's shared pair rows, which
the MoE block then adds in the experts' fp32 sum (`moe_combine.combine_pointwise`'s
`shared_rows`). The maths is `moe_route_shared_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_route import (
    MAX_KERNEL_EXPERTS,
    MAX_KERNEL_TOP_K,
    check_route_args,
    moe_route_reference,
    route_constants,
    route_tokens,
    route_warps_per_token,
)
from dlmc.custom_ops.moe_shared_parts import shared_down_part, shared_parts, shared_split
from dlmc.custom_ops.nvfp4_moe import shared_part_tiles
from dlmc.custom_ops.router_shared import SHARED_BLOCK_M

__all__ = ["moe_route_shared", "moe_route_shared_reference"]

# warps per program: the down parts' dots want four (a token's routing tile takes any number)
SHARED_WARPS = 4


@triton.jit
def route_shared_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, h_ptr, down_w, y_ptr,
                        tokens, stride_split, stride_logits, routed_scaling_factor, stride_h,
                        stride_y, NUM_SPLITS: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                        GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                        NORM_TOPK_PROB: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        PARTS: tl.constexpr, SH_BLOCK_M: tl.constexpr,
                        SH_BLOCK_N: tl.constexpr, SH_SPLIT: tl.constexpr,
                        SH_BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Programs 0..T-1: one token's routing each; then the shared expert's down parts (PARTS
    per H-tile, parts first)."""
    pid = tl.program_id(0)
    if pid < tokens:
        token = pid.to(tl.int64) + tl.arange(0, 1)  # [1]
        route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, token, token >= 0,
                     stride_split, stride_logits, routed_scaling_factor, NUM_SPLITS,
                     NUM_EXPERTS, GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K,
                     TOP_K_PAD, NORM_TOPK_PROB)
    else:
        q = pid - tokens
        shared_down_part(h_ptr, down_w, y_ptr, q % PARTS, q // PARTS, tokens, 1, 0, H, I,
                         stride_h, stride_y, SH_BLOCK_M, SH_BLOCK_N, SH_SPLIT, SH_BLOCK_K,
                         INTERPRETED)


def _impl(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
          top_k: int, norm_topk_prob: bool, routed_scaling_factor: float, h: torch.Tensor,
          shared_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits if logits.dim() == 3 else logits.unsqueeze(0)  # [S, T, E]
    tokens, num_experts = logits.shape[1], logits.shape[2]
    hidden, inter = shared_down.shape
    topk_ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    y = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=logits.device)
    if tokens == 0:
        return topk_ids, topk_weights, y
    block_n, block_k = shared_part_tiles(hidden, inter)["down"]
    parts = shared_parts(tokens, SHARED_BLOCK_M, block_n)
    launcher(route_shared_kernel)[(tokens + parts * triton.cdiv(hidden, block_n),)](
        logits, expert_bias, topk_ids, topk_weights, h, shared_down, y, tokens,
        logits.stride(0), logits.stride(1), routed_scaling_factor, h.stride(0), y.stride(0),
        **route_constants(logits, n_group, topk_group, top_k, norm_topk_prob), H=hidden,
        I=inter, PARTS=parts, SH_BLOCK_M=SHARED_BLOCK_M, SH_BLOCK_N=block_n,
        SH_SPLIT=shared_split(block_n), SH_BLOCK_K=block_k, INTERPRETED=_INTERPRETED,
        num_warps=max(SHARED_WARPS, route_warps_per_token(num_experts, n_group)))
    return topk_ids, topk_weights, y


def _fake(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
          top_k: int, norm_topk_prob: bool, routed_scaling_factor: float, h: torch.Tensor,
          shared_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = logits.shape[-2]
    return (logits.new_empty((tokens, top_k), dtype=torch.int64),
            logits.new_empty((tokens, top_k), dtype=torch.float32),
            h.new_empty((tokens, shared_down.shape[0]), dtype=torch.bfloat16))


_op = traced_triton_op("dlmc::moe_route_shared", _impl, _fake)


def moe_route_shared(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                     topk_group: int, top_k: int, norm_topk_prob: bool,
                     routed_scaling_factor: float, h: torch.Tensor, shared_down: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_route` and the shared expert's output, one launch (`dlmc::moe_route_shared`).

    Routing arguments and results as `moe_route` (logits fp32 `[T, E]` or `[S, T, E]`); h bf16
    `[T, I]` (`router_gemm_shared`'s), shared_down bf16 `[H, I]` contiguous. Returns
    (`topk_ids` int64 `[T, K]`, `topk_weights` fp32 `[T, K]`, bf16 `[T, H]` `bf16(h @ down^T)`).
    The kernel runs on CUDA and under `TRITON_INTERPRET=1` where `moe_route`'s does;
    `moe_route_shared_reference` otherwise. No host sync.
    """
    check_route_args("moe_route_shared", logits, expert_bias, n_group, topk_group, top_k)
    tokens, inter = logits.shape[-2], h.shape[-1]
    if h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[0] != tokens:
        raise ValueError(f"moe_route_shared: h must be bf16 [T={tokens}, I], got {h.dtype} "
                         f"{tuple(h.shape)}")
    if (shared_down.dtype != torch.bfloat16 or shared_down.dim() != 2
            or shared_down.shape[1] != inter or not shared_down.is_contiguous()):
        raise ValueError(f"moe_route_shared: shared_down must be contiguous bf16 [H, I={inter}] "
                         f"(I: h's width), got {shared_down.dtype} {tuple(shared_down.shape)}")
    if ((logits.is_cuda or _INTERPRETED) and logits.shape[-1] <= MAX_KERNEL_EXPERTS
            and top_k <= MAX_KERNEL_TOP_K):
        return _op(logits.contiguous(), expert_bias.contiguous(), n_group, topk_group, top_k,
                   norm_topk_prob, routed_scaling_factor, h.contiguous(), shared_down)
    return moe_route_shared_reference(logits, expert_bias, n_group, topk_group, top_k,
                                      norm_topk_prob, routed_scaling_factor, h, shared_down)


def moe_route_shared_reference(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                               topk_group: int, top_k: int, norm_topk_prob: bool,
                               routed_scaling_factor: float, h: torch.Tensor,
                               shared_down: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_route_shared` in torch ops: `moe_route_reference` and `F.linear(h, down)` (bf16)."""
    ids, weights = moe_route_reference(logits, expert_bias, n_group, topk_group, top_k,
                                       norm_topk_prob, routed_scaling_factor)
    return ids, weights, F.linear(h, shared_down)
