"""`dlmc::moe_route_align`: `dlmc::moe_route` then `dlmc::moe_align` in one Triton program.

Per MoE layer of a diffusion block the router's top-k (`moe_route`, one program per token) and
the routing prep of the grouped expert kernels (`moe_align`, one program) are two latency-bound
launches. Here one program routes all T tokens as a `[T_PAD, G, S]` register tile (the same
`route_tokens` maths, every reduction per token), stores `topk_ids`/`topk_weights`, waits at a
barrier, and aligns the `T*K` pairs with the same `align_pairs` sort: results equal (`torch.equal`)
`moe_route` followed by `align_pairs_to_blocks` at `route_block_m`'s block_m. Static shapes, no
host sync (graph-capturable). The maths is `moe_route_align_reference`.

One-program limits (beyond them `moe_route_align` runs the two ops, each with its own limits):
`T_PAD * G_PAD * S_PAD <= MAX_FUSED_TILE` (the routing tile in registers: T <= 64 at E = 256),
`T*K <= moe_align.MAX_KERNEL_PAIRS`, `E <= MAX_KERNEL_EXPERTS` and `K <= MAX_KERNEL_TOP_K`
(moe_route's, 512 and 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops import moe_align as _align
from dlmc.custom_ops import moe_route as _route
from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_align import (
    PairRouting,
    align_launch,
    align_pairs,
    align_pairs_to_blocks_reference,
    aligned_blocks,
    route_block_m,
    route_pairs,
)
from dlmc.custom_ops.moe_route import (
    check_route_args,
    moe_route,
    moe_route_reference,
    route_constants,
    route_tokens,
    route_warps_per_token,
)

__all__ = ["moe_route_align", "moe_route_align_reference", "route_align_outputs",
           "route_align_setup"]

MAX_FUSED_TILE = 16384  # T_PAD * G_PAD * S_PAD fp32 routing values: 16 per thread at 32 warps
MAX_WARPS = 32
# Launch override for perf/bench_small_m_linear.py (None: `_num_warps`).
_NUM_WARPS: int | None = None


@triton.jit
def moe_route_align_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, sorted_pair_ptr,
                           expert_of_block_ptr, num_tokens, stride_split, stride_logits,
                           routed_scaling_factor, shared_expert, TOKENS_PAD: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                           GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                           GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                           NORM_TOPK_PROB: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                           BLOCK_M: tl.constexpr, LOG_PAIRS_PAD: tl.constexpr,
                           EXPERTS_PAD: tl.constexpr, SHARED_BLOCKS: tl.constexpr,
                           FILL: tl.constexpr):
    token = tl.arange(0, TOKENS_PAD).to(tl.int64)  # [T_PAD]
    route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, token, token < num_tokens,
                 stride_split, stride_logits, routed_scaling_factor, NUM_SPLITS, NUM_EXPERTS,
                 GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOP_K_PAD,
                 NORM_TOPK_PROB)
    tl.debug_barrier()  # every token's ids are stored (and visible) before the sort reads them
    align_pairs(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_tokens * TOP_K, TOP_K,
                shared_expert, NUM_BLOCKS, BLOCK_M, LOG_PAIRS_PAD, EXPERTS_PAD, SHARED_BLOCKS,
                FILL)


def route_align_outputs(logits: torch.Tensor, top_k: int, block_m: int, shared_expert: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised `topk_ids` int64 `[T, K]`, `topk_weights` fp32 `[T, K]`, `sorted_pair` int32
    `[B * block_m]` and `expert_of_block` int32 `[B]` for logits `[..., T, E]` (also fake)."""
    tokens, num_experts = logits.shape[-2], logits.shape[-1]
    num_blocks = aligned_blocks(tokens, top_k, num_experts, block_m, shared_expert)
    return (logits.new_empty((tokens, top_k), dtype=torch.int64),
            logits.new_empty((tokens, top_k), dtype=torch.float32),
            logits.new_empty(num_blocks * block_m, dtype=torch.int32),
            logits.new_empty(num_blocks, dtype=torch.int32))


def route_align_setup(logits: torch.Tensor, top_k: int, block_m: int, shared_expert: bool
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, int], int]:
    """What a fused routing launch needs: the logits as `[S, T, E]`, `route_align_outputs`, and
    `align_launch`'s constexprs and warps (`{}` and 0 for an empty block, which has no launch)."""
    logits = logits if logits.dim() == 3 else logits.unsqueeze(0)  # [S, T, E]
    _, tokens, num_experts = logits.shape
    outputs = route_align_outputs(logits, top_k, block_m, shared_expert)
    if tokens == 0:
        return logits, outputs, {}, 0
    return logits, outputs, *align_launch(tokens, top_k, num_experts, block_m, shared_expert)


def _num_warps(tokens: int, num_experts: int, n_group: int, align_warps: int) -> int:
    """A warp group per token (moe_route's), up to MAX_WARPS, and at least moe_align's."""
    route_warps = triton.next_power_of_2(tokens) * route_warps_per_token(num_experts, n_group)
    return _NUM_WARPS or max(align_warps, min(MAX_WARPS, route_warps))


def _moe_route_align_impl(
    logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
    norm_topk_prob: bool, routed_scaling_factor: float, block_m: int, shared_expert: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, outputs, align_constants, align_warps = route_align_setup(logits, top_k, block_m,
                                                                      shared_expert)
    _, tokens, num_experts = logits.shape
    if tokens == 0:
        return outputs
    launcher(moe_route_align_kernel)[(1,)](
        logits, expert_bias, *outputs, tokens, logits.stride(0), logits.stride(1),
        routed_scaling_factor, num_experts,
        TOKENS_PAD=triton.next_power_of_2(tokens),
        **route_constants(logits, n_group, topk_group, top_k, norm_topk_prob),
        **align_constants, num_warps=_num_warps(tokens, num_experts, n_group, align_warps))
    return outputs


def _moe_route_align_fake(
    logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
    norm_topk_prob: bool, routed_scaling_factor: float, block_m: int, shared_expert: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_align_outputs(logits, top_k, block_m, shared_expert)


_moe_route_align_op = traced_triton_op("dlmc::moe_route_align", _moe_route_align_impl,
                                       _moe_route_align_fake)


def fused_kernel_applies(logits: torch.Tensor, n_group: int, top_k: int) -> bool:
    """Whether `moe_route_align` runs the one program (CUDA or `TRITON_INTERPRET=1`, within the
    limits of the module docstring) rather than the two ops."""
    tokens, num_experts = logits.shape[-2], logits.shape[-1]
    tile = (triton.next_power_of_2(max(tokens, 1)) * triton.next_power_of_2(n_group)
            * triton.next_power_of_2(num_experts // n_group))
    return ((logits.is_cuda or _INTERPRETED) and tile <= MAX_FUSED_TILE
            and tokens * top_k <= _align.MAX_KERNEL_PAIRS
            and num_experts <= min(_align.MAX_KERNEL_EXPERTS, _route.MAX_KERNEL_EXPERTS)
            and top_k <= _route.MAX_KERNEL_TOP_K)


def moe_route_align(
    logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
    norm_topk_prob: bool, routed_scaling_factor: float, shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, PairRouting]:
    """Group-limited sigmoid routing and the grouped kernels' alignment in one Triton launch.

    Arguments as `moe_route`: logits fp32 `[T, E]` or `[S, T, E]` (split-K partials summed in
    order s = 0, 1, ...), expert_bias fp32 `[E]`; `shared_expert`: every token also takes
    expert E (the fused shared expert, see `align_pairs_to_blocks`). Returns `topk_ids` int64
    `[T, K]`, `topk_weights` fp32 `[T, K]` (`moe_route`'s) and `PairRouting(block_m,
    sorted_pair int32 [B * block_m], expert_of_block int32 [B])` with `block_m =
    route_block_m(T, K, E, shared_expert)`: `align_pairs_to_blocks(topk_ids, E, block_m,
    shared_expert)`'s, what `route_pairs` gives the expert kernels. All equal to the two ops bit
    for bit. `dlmc::moe_route_align` on CUDA and under `TRITON_INTERPRET=1` within the one-program
    limits (module docstring); `moe_route` then `align_pairs_to_blocks` otherwise.
    """
    check_route_args("moe_route_align", logits, expert_bias, n_group, topk_group, top_k)
    num_experts = logits.shape[-1]
    block_m = route_block_m(logits.shape[-2], top_k, num_experts, shared_expert)
    route_args = (n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    if fused_kernel_applies(logits, n_group, top_k):
        ids, weights, sorted_pair, expert_of_block = _moe_route_align_op(
            logits.contiguous(), expert_bias.contiguous(), *route_args, block_m, shared_expert)
        return ids, weights, PairRouting(block_m, sorted_pair, expert_of_block)
    ids, weights = moe_route(logits, expert_bias, *route_args)
    return ids, weights, route_pairs(ids, num_experts, shared_expert)  # the same block_m


def moe_route_align_reference(
    logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
    norm_topk_prob: bool, routed_scaling_factor: float, shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, PairRouting]:
    """`moe_route_align` in torch ops only: `moe_route_reference`, then
    `align_pairs_to_blocks_reference` at `route_block_m`'s block_m; same arguments and results."""
    ids, weights = moe_route_reference(logits, expert_bias, n_group, topk_group, top_k,
                                       norm_topk_prob, routed_scaling_factor)
    num_experts = logits.shape[-1]
    block_m = route_block_m(logits.shape[-2], top_k, num_experts, shared_expert)
    return ids, weights, PairRouting(block_m, *align_pairs_to_blocks_reference(
        ids, num_experts, block_m, shared_expert))
