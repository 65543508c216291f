"""`dlmc::moe_route_last_align`: `moe_route`'s programs, and the last of them aligns the pairs.

`dlmc::moe_route` routes one token per program; `dlmc::moe_align` then sorts all `T*K` pairs in
one program of a second launch. Here the same per-token programs each take a ticket from a
one-element counter once their token's ids and weights are stored (a release/acquire atomic
after a CTA barrier); the program that draws the last ticket sees every token's picks and runs
`align_pairs`, then sets the counter back to 0 for the next launch (stream order). One launch
instead of two, and no single program routes all tokens (the one-program `moe_route_align`
measured 27.6 µs per layer against 4.7 + 3.6 for the two launches, perf/README.md session 13).
Results equal `moe_route` then `align_pairs_to_blocks` bit for bit; the maths is
`moe_route_align_reference`.

The counter is state the caller keeps: an int32 `[1]` tensor of zeros on the logits' device,
one per call site that may run concurrently (the model keeps one per MoE layer,
`MoEBlock.route_ticket`), mutated in place (capturable in a CUDA graph: every launch leaves it
at 0). Under the interpreter the programs run one after another, so the last one runs last.
Opt-in in the model (`DLMC_FUSED_ROUTE_ALIGN=last`); off by default: on the H200 it took 10.4 µs
per layer against 4.7 + 3.7 µs for `moe_route` + `moe_align` (the last program's serial
alignment is longer than the launch it saves; perf/README.md, session 18). Session 40, with
the leaner `moe_align`: 9.3 against 4.7 + 3.3 µs in the round's profile, rounds 0.04 ms slower;
alone (perf/probe_route_align.py) 9.2 µs at 4 warps, 10.3-10.5 at 1-2, against 7.5 for the two
launches: at 4 warps `moe_route`'s part alone takes 6.4 µs against 4.5 at its own 1 warp.
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
    align_pairs,
    route_block_m,
    route_pairs,
)
from dlmc.custom_ops.moe_route import (
    check_route_args,
    moe_route,
    route_constants,
    route_tokens,
    route_warps_per_token,
)
from dlmc.custom_ops.moe_route_align import route_align_outputs, route_align_setup

__all__ = ["last_align_applies", "moe_route_last_align"]


@triton.jit
def moe_route_last_align_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, sorted_pair_ptr, expert_of_block_ptr, ticket_ptr,
    stride_split, stride_logits, routed_scaling_factor, shared_expert, NUM_SPLITS: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr, NORM_TOPK_PROB: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG_PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
    SHARED_BLOCKS: tl.constexpr, FILL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # [1]: one token per program
    route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, token, token >= 0, stride_split,
                 stride_logits, routed_scaling_factor, NUM_SPLITS, NUM_EXPERTS, GROUP_SIZE,
                 GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOP_K_PAD, NORM_TOPK_PROB)
    tl.debug_barrier()  # every thread's stores of this token come before the ticket
    num_tokens = tl.num_programs(0)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == num_tokens - 1:  # the last program: every token's ids are stored and visible
        tl.debug_barrier()
        align_pairs(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_tokens * TOP_K, TOP_K,
                    shared_expert, NUM_BLOCKS, BLOCK_M, LOG_PAIRS_PAD, EXPERTS_PAD,
                    SHARED_BLOCKS, FILL)
        tl.store(ticket_ptr, 0)  # ready for the next launch


def _moe_route_last_align_impl(
    logits: torch.Tensor, expert_bias: torch.Tensor, ticket: torch.Tensor, n_group: int,
    topk_group: int, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float,
    block_m: int, shared_expert: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, outputs, align_constants, align_warps = route_align_setup(logits, top_k, block_m,
                                                                      shared_expert)
    _, tokens, num_experts = logits.shape
    if tokens == 0:
        return outputs
    warps = max(align_warps, route_warps_per_token(num_experts, n_group))
    launcher(moe_route_last_align_kernel)[(tokens,)](  # a program per token
        logits, expert_bias, *outputs, ticket, logits.stride(0), logits.stride(1),
        routed_scaling_factor, num_experts, **align_constants,
        **route_constants(logits, n_group, topk_group, top_k, norm_topk_prob), num_warps=warps)
    return outputs


def _moe_route_last_align_fake(
    logits: torch.Tensor, expert_bias: torch.Tensor, ticket: torch.Tensor, n_group: int,
    topk_group: int, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float,
    block_m: int, shared_expert: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_align_outputs(logits, top_k, block_m, shared_expert)


# Inductor traces through the body (four allocations + the kernel, the ticket written in
# place); opaque when interpreted.
_moe_route_last_align_op = traced_triton_op(
    "dlmc::moe_route_last_align", _moe_route_last_align_impl, _moe_route_last_align_fake,
    mutates_args=("ticket",))


def last_align_applies(logits: torch.Tensor, top_k: int) -> bool:
    """Whether `moe_route_last_align` runs its kernel (CUDA or `TRITON_INTERPRET=1`, both ops'
    kernel limits) rather than the two ops."""
    tokens, num_experts = logits.shape[-2], logits.shape[-1]
    return ((logits.is_cuda or _INTERPRETED) and tokens * top_k <= _align.MAX_KERNEL_PAIRS
            and num_experts <= min(_align.MAX_KERNEL_EXPERTS, _route.MAX_KERNEL_EXPERTS)
            and top_k <= _route.MAX_KERNEL_TOP_K)


def moe_route_last_align(
    logits: torch.Tensor, expert_bias: torch.Tensor, ticket: torch.Tensor, n_group: int,
    topk_group: int, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float,
    shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, PairRouting]:
    """`moe_route_align`'s results (same arguments, plus `ticket`) from one launch of per-token
    programs whose last aligns the pairs (module docstring).

    ticket: int32 `[1]` on the logits' device, 0 before the call and left at 0 (the caller
    keeps it). Returns `topk_ids` int64 `[T, K]`, `topk_weights` fp32 `[T, K]` and
    `PairRouting(block_m, sorted_pair, expert_of_block)` at `route_block_m`'s block_m, equal to
    `moe_route` then `route_pairs` bit for bit (which run instead beyond the kernels' limits).
    """
    check_route_args("moe_route_last_align", logits, expert_bias, n_group, topk_group, top_k)
    if ticket.dtype != torch.int32 or ticket.shape != (1,) or ticket.device != logits.device:
        raise ValueError(f"moe_route_last_align: ticket must be int32 [1] on {logits.device}, "
                         f"got {ticket.dtype} {tuple(ticket.shape)} on {ticket.device}")
    num_experts = logits.shape[-1]
    block_m = route_block_m(logits.shape[-2], top_k, num_experts, shared_expert)
    route_args = (n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    if last_align_applies(logits, top_k):
        ids, weights, sorted_pair, expert_of_block = _moe_route_last_align_op(
            logits.contiguous(), expert_bias.contiguous(), ticket, *route_args, block_m,
            shared_expert)
        return ids, weights, PairRouting(block_m, sorted_pair, expert_of_block)
    ids, weights = moe_route(logits, expert_bias, *route_args)
    return ids, weights, route_pairs(ids, num_experts, shared_expert)  # the same block_m
