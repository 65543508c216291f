"""`dlmc::moe_route`: the LLaDA2 router after its GEMM, in one Triton launch.

The logits come whole (`[T, E]`) or as S split-K partials (`[S, T, E]`, from `dlmc::router_gemm`)
that the kernel sums in a fixed order (s = 0, 1, ..., S-1, left to right), so the split GEMM needs
no reduce kernel of its own; `moe_route_reference` sums the same way first.

Sigmoid scores, the selection-only expert bias, group-limited top-k (a group's score is the sum of
its two best biased scores, the `topk_group` best groups are kept, the `top_k` best experts of the
kept groups are picked) and the weights (unbiased scores of the picks, optionally renormalised,
times the routed scaling factor): one program per token, instead of ~8 small torch kernels. Static
grid, no host sync (graph-capturable). The maths is `moe_route_reference` (torch ops only), which
also serves CPU runs without Triton's interpreter and sizes beyond the kernel's limits.

Order and ties: the k picks come in descending biased score, like `torch.topk`; equal scores (groups
or experts) go to the lowest index. The reference breaks ties the same way (stable sorts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op

__all__ = ["moe_route", "moe_route_reference"]

# One program holds a token's scores in registers and picks by repeated max: larger routings take
# the torch path.
MAX_KERNEL_EXPERTS = 512
MAX_KERNEL_TOP_K = 16


@triton.jit
def _argmax_first(values, candidate, index, NONE: tl.constexpr):
    """Per row of `values [TT, N]`: the lowest `index [1, N]` of the largest value among
    `candidate`s (NONE if none is). -> `[TT]`"""
    best = tl.max(tl.where(candidate, values, float("-inf")), 1)  # [TT]
    return tl.min(tl.where(candidate & (values == best[:, None]), index, NONE), 1)


@triton.jit
def route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, token, is_token, stride_split,
                 stride_logits, routed_scaling_factor, NUM_SPLITS: tl.constexpr,
                 NUM_EXPERTS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                 GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                 TOP_K_PAD: tl.constexpr, NORM_TOPK_PROB: tl.constexpr):
    """Route the tokens `token [TT]` (int64; rows where `is_token [TT]` is False are padding):
    a `[TT, G, S]` tile, every reduction per token. `moe_route_kernel` runs it for one token per
    program, `dlmc::moe_route_align` for all tokens in one program; both give the same bits (the
    weights' sum runs in slot order, not in `tl.sum`'s layout-dependent order)."""
    TOKENS: tl.constexpr = token.shape[0]
    group = tl.arange(0, GROUPS_PAD)[None, :]  # [1, G]
    member = tl.arange(0, GROUP_PAD)[None, None, :]  # [1, 1, S]
    expert = group[:, :, None] * GROUP_SIZE + member  # [1, G, S]
    is_expert = (member < GROUP_SIZE) & (expert < NUM_EXPERTS)
    row = logits_ptr + token[:, None, None] * stride_logits + expert  # [TT, G, S]
    load_mask = is_expert & is_token[:, None, None]
    logits = tl.load(row, mask=load_mask, other=0.0)  # [TT, G, S], split 0
    for split in tl.static_range(1, NUM_SPLITS):  # fixed order: deterministic, as the reference
        logits += tl.load(row + split * stride_split, mask=load_mask, other=0.0)
    scores = tl.sigmoid(logits)  # [TT, G, S]
    bias = tl.load(bias_ptr + expert, mask=is_expert, other=0.0)  # [1, G, S]
    biased = tl.where(is_expert, scores + bias, float("-inf"))  # [TT, G, S], selection only
    # Group score: the sum of the group's two best biased scores (the best one for groups of 1).
    top1 = tl.max(biased, 2)  # [TT, G]
    group_score = top1
    if GROUP_SIZE > 1:
        first = tl.min(tl.where(biased == top1[:, :, None], member, GROUP_PAD), 2)  # [TT, G]
        group_score = top1 + tl.max(
            tl.where(member == first[:, :, None], float("-inf"), biased), 2)
    is_group = group * GROUP_SIZE < NUM_EXPERTS  # [1, G]
    kept = tl.zeros([TOKENS, GROUPS_PAD], dtype=tl.int1)  # [TT, G]
    for _ in tl.static_range(TOPK_GROUP):
        pick = _argmax_first(group_score, is_group & ~kept, group, GROUPS_PAD)  # [TT]
        kept = kept | (group == pick[:, None])
    # Experts outside the kept groups score -inf, as in the reference's masked_fill.
    masked = tl.where(kept[:, :, None], biased, float("-inf"))  # [TT, G, S]
    slot = tl.arange(0, TOP_K_PAD)[None, :]  # [1, K]
    taken = tl.zeros([TOKENS, GROUPS_PAD, GROUP_PAD], dtype=tl.int1)  # [TT, G, S]
    topk_ids = tl.zeros([TOKENS, TOP_K_PAD], dtype=tl.int64)
    topk_weights = tl.zeros([TOKENS, TOP_K_PAD], dtype=tl.float32)
    total = tl.zeros([TOKENS], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        candidate = is_expert & ~taken
        best = tl.max(tl.max(tl.where(candidate, masked, float("-inf")), 2), 1)  # [TT]
        pick = tl.min(tl.min(tl.where(candidate & (masked == best[:, None, None]), expert,
                                      NUM_EXPERTS), 2), 1)  # [TT], ties to the lowest id
        pick = tl.minimum(pick, NUM_EXPERTS - 1)  # NaN scores: stay a valid expert id
        chosen = expert == pick[:, None, None]  # [TT, G, S]
        taken = taken | chosen
        topk_ids = tl.where(slot == k, pick[:, None].to(tl.int64), topk_ids)
        weight = tl.sum(tl.sum(tl.where(chosen, scores, 0.0), 2), 1)  # [TT], the unbiased score
        topk_weights = tl.where(slot == k, weight[:, None], topk_weights)
        total += weight  # slot order
    if NORM_TOPK_PROB:
        topk_weights = topk_weights / (total + 1e-20)[:, None]
    out = token[:, None] * TOP_K + slot  # [TT, K]
    is_out = (slot < TOP_K) & is_token[:, None]
    tl.store(ids_ptr + out, topk_ids, mask=is_out)
    tl.store(weights_ptr + out, topk_weights * routed_scaling_factor, mask=is_out)


@triton.jit
def moe_route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_split, stride_logits,
                     routed_scaling_factor, NUM_SPLITS: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr,
                     GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORM_TOPK_PROB: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # [1]: one token per program
    route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, token, token >= 0, stride_split,
                 stride_logits, routed_scaling_factor, NUM_SPLITS, NUM_EXPERTS, GROUP_SIZE,
                 GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOP_K_PAD, NORM_TOPK_PROB)


def _moe_route_impl(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                    topk_group: int, top_k: int, norm_topk_prob: bool,
                    routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits if logits.dim() == 3 else logits.unsqueeze(0)  # [S, T, E]
    splits, tokens, num_experts = logits.shape
    topk_ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return topk_ids, topk_weights
    launcher(moe_route_kernel)[(tokens,)](
        logits, expert_bias, topk_ids, topk_weights, logits.stride(0), logits.stride(1),
        routed_scaling_factor, **route_constants(logits, n_group, topk_group, top_k,
                                                 norm_topk_prob),
        num_warps=route_warps_per_token(num_experts, n_group))
    return topk_ids, topk_weights


def route_constants(logits: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                    norm_topk_prob: bool) -> dict[str, int | bool]:
    """`route_tokens`' constexprs for `[S, T, E]` logits."""
    splits, num_experts = logits.shape[0], logits.shape[-1]
    group_size = num_experts // n_group
    return {"NUM_SPLITS": splits, "NUM_EXPERTS": num_experts, "GROUP_SIZE": group_size,
            "GROUPS_PAD": triton.next_power_of_2(n_group),
            "GROUP_PAD": triton.next_power_of_2(group_size), "TOPK_GROUP": topk_group,
            "TOP_K": top_k, "TOP_K_PAD": triton.next_power_of_2(top_k),
            "NORM_TOPK_PROB": norm_topk_prob}


def _moe_route_fake(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                    topk_group: int, top_k: int,
                    *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.shape[-2]
    return (logits.new_empty((tokens, top_k), dtype=torch.int64),
            logits.new_empty((tokens, top_k), dtype=torch.float32))


_moe_route_op = traced_triton_op("dlmc::moe_route", _moe_route_impl, _moe_route_fake)


def _kernel_applies(logits: torch.Tensor, top_k: int) -> bool:
    return ((logits.is_cuda or _INTERPRETED) and logits.shape[-1] <= MAX_KERNEL_EXPERTS
            and top_k <= MAX_KERNEL_TOP_K)


def check_route_args(op: str, logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                     topk_group: int, top_k: int) -> None:
    """`moe_route`'s argument checks (shared with `moe_route_align`); errors name `op`."""
    if logits.dtype != torch.float32 or logits.dim() not in (2, 3):
        raise ValueError(f"{op}: logits must be fp32 [T, E] or [S, T, E], got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    num_experts = logits.shape[-1]
    if expert_bias.dtype != torch.float32 or expert_bias.shape != (num_experts,):
        raise ValueError(f"{op}: expert_bias must be fp32 [E={num_experts}], got "
                         f"{expert_bias.dtype} {tuple(expert_bias.shape)}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{op}: n_group ({n_group}) must divide E ({num_experts}) and "
                         f"topk_group ({topk_group}) be in 1..n_group")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"{op}: top_k ({top_k}) must be in 1..{topk_group} kept groups x "
                         f"{num_experts // n_group} experts")


def route_warps_per_token(num_experts: int, n_group: int) -> int:
    """Warps for one token's `[G, S]` register tile."""
    tile = triton.next_power_of_2(n_group) * triton.next_power_of_2(num_experts // n_group)
    return 1 if tile <= 256 else 2 if tile <= 512 else 4


def moe_route(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int, topk_group: int,
              top_k: int, norm_topk_prob: bool,
              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing of the router logits (one Triton launch, `dlmc::moe_route`).

    logits fp32 `[T, E]` (`x @ W^T` of the router) or `[S, T, E]`: S split-K partials
    (`dlmc::router_gemm`), summed over S in order s = 0, 1, ... (left to right);
    expert_bias fp32 `[E]` (selection only); `n_group` divides E;
    `1 <= topk_group <= n_group`; `1 <= top_k <= topk_group * E / n_group`.
    Returns `topk_ids` int64 `[T, top_k]` (descending biased score, ties to the lower id) and
    `topk_weights` fp32 `[T, top_k]`: the picks' sigmoid scores, divided by their sum (+1e-20)
    if `norm_topk_prob`, times `routed_scaling_factor`. The kernel runs on CUDA and under
    `TRITON_INTERPRET=1` for E <= 512 and top_k <= 16; `moe_route_reference` otherwise.
    """
    check_route_args("moe_route", logits, expert_bias, n_group, topk_group, top_k)
    if _kernel_applies(logits, top_k):
        return _moe_route_op(logits.contiguous(), expert_bias.contiguous(), n_group, topk_group,
                             top_k, norm_topk_prob, routed_scaling_factor)
    return moe_route_reference(logits, expert_bias, n_group, topk_group, top_k, norm_topk_prob,
                               routed_scaling_factor)


def _topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """`values.topk(k).indices` with ties to the lower index (a stable descending sort)."""
    return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def moe_route_reference(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                        topk_group: int, top_k: int, norm_topk_prob: bool,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` in torch ops only (static shapes, no host sync); same arguments and results.
    `[S, T, E]` partials are summed first, in order s = 0, 1, ... (as the kernel does)."""
    if logits.dim() == 3:
        total = logits[0]
        for partial in logits[1:]:
            total = total + partial  # [T, E], left to right
        logits = total
    tokens = logits.shape[0]
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + expert_bias.float()  # [T, E], selection only
    grouped = biased.view(tokens, n_group, -1)  # [T, G, E/G]
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
    kept = _topk_indices(group_scores, topk_group)  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, -1)  # [T, E]
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    topk_ids = _topk_indices(masked, top_k)  # [T, K]
    topk_weights = scores.gather(1, topk_ids)  # [T, K], unbiased sigmoid
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * routed_scaling_factor
