"""`dlmc::gemma_route`: DiffusionGemma's router after its projection, in one Triton launch.

The router's logits `[T, E]` (bf16, as the projection gives them, or fp32) -> the softmax over
the experts in fp32, the top k by repeated max, the picks renormalised to sum to 1 (their sum
in slot order) and each multiplied by `per_expert_scale` of its expert. One program per token;
replaces the softmax, `torch.topk` (a gather kernel and a bitonic sort per layer) and the
normalisation Inductor would otherwise launch. Static grid, no host sync (graph-capturable).
`gemma_route_reference` is the maths in torch ops, as `GemmaRouter` writes it.

Order and ties: the picks come in descending probability, like `torch.topk`; equal
probabilities go to the lowest expert id (torch.topk leaves their order unspecified).
The kernel's exp is not torch's bit for bit: weights agree to a few fp32 ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op

__all__ = ["MAX_KERNEL_EXPERTS", "MAX_KERNEL_TOP_K", "gemma_route", "gemma_route_reference"]

# One program holds a token's probabilities in registers and picks by repeated max: larger
# routings take the torch path.
MAX_KERNEL_EXPERTS = 1024
MAX_KERNEL_TOP_K = 32
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def gemma_route_kernel(logits_ptr, scale_ptr, ids_ptr, weights_ptr, stride_logits,
                       NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                       TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    expert = tl.arange(0, EXPERTS_PAD)  # [E]
    is_expert = expert < NUM_EXPERTS
    logits = tl.load(logits_ptr + token * stride_logits + expert, mask=is_expert,
                     other=float("-inf")).to(tl.float32)  # [E]
    shifted = logits - tl.max(logits, 0)
    exps = tl.where(is_expert, tl.exp(shifted), 0.0)
    probs = exps / tl.sum(exps, 0)  # [E], the softmax
    slot = tl.arange(0, TOP_K_PAD)  # [K]
    taken = expert < 0  # [E], nothing yet
    topk_ids = tl.zeros([TOP_K_PAD], dtype=tl.int64)
    topk_weights = tl.zeros([TOP_K_PAD], dtype=tl.float32)
    total = 0.0
    for k in tl.static_range(TOP_K):
        candidate = is_expert & ~taken
        best = tl.max(tl.where(candidate, probs, -1.0), 0)
        pick = tl.min(tl.where(candidate & (probs == best), expert, NUM_EXPERTS), 0)
        pick = tl.minimum(pick, NUM_EXPERTS - 1)  # NaN logits: stay a valid expert id
        taken = taken | (expert == pick)
        weight = tl.sum(tl.where(expert == pick, probs, 0.0), 0)
        topk_ids = tl.where(slot == k, pick.to(tl.int64), topk_ids)
        topk_weights = tl.where(slot == k, weight, topk_weights)
        total += weight  # slot order
    is_out = slot < TOP_K
    scale = tl.load(scale_ptr + topk_ids, mask=is_out, other=0.0).to(tl.float32)
    out = token * TOP_K + slot
    tl.store(ids_ptr + out, topk_ids, mask=is_out)
    tl.store(weights_ptr + out, topk_weights / total * scale, mask=is_out)


def _gemma_route_impl(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = logits.shape
    topk_ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return topk_ids, topk_weights
    pad = triton.next_power_of_2(num_experts)
    launcher(gemma_route_kernel)[(tokens,)](
        logits, per_expert_scale, topk_ids, topk_weights, logits.stride(0),
        NUM_EXPERTS=num_experts, EXPERTS_PAD=pad, TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k), num_warps=1 if pad <= 256 else 4)
    return topk_ids, topk_weights


def _gemma_route_fake(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    return (logits.new_empty((tokens, top_k), dtype=torch.int64),
            logits.new_empty((tokens, top_k), dtype=torch.float32))


_gemma_route_op = traced_triton_op("dlmc::gemma_route", _gemma_route_impl, _gemma_route_fake)


def gemma_route_reference(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                          top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemma_route` in torch ops (the maths of `GemmaRouter`); same arguments and results."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k=top_k, dim=-1)  # [T, K]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, (weights * per_expert_scale[ids]).float()


def gemma_route(logits: torch.Tensor, per_expert_scale: torch.Tensor,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffusionGemma's routing of the router's logits (one Triton launch, `dlmc::gemma_route`).

    logits: bf16, fp16 or fp32 `[T, E]` (the router projection's output); per_expert_scale:
    `[E]` (any float dtype, on logits' device); `1 <= top_k <= E`. Returns `topk_ids` int64
    `[T, top_k]` (descending probability, ties to the lower id) and `topk_weights` fp32
    `[T, top_k]`: the picks' softmax probabilities divided by their sum, times their experts'
    `per_expert_scale`. The kernel runs on CUDA and under `TRITON_INTERPRET=1` for E <= 1024
    and top_k <= 32; `gemma_route_reference` otherwise.
    """
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"gemma_route: logits must be a float [T, E] tensor, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if (per_expert_scale.shape != (num_experts,) or not per_expert_scale.is_floating_point()
            or per_expert_scale.device != logits.device):
        raise ValueError(f"gemma_route: per_expert_scale must be a float [E={num_experts}] "
                         f"tensor on {logits.device}, got {per_expert_scale.dtype} "
                         f"{tuple(per_expert_scale.shape)} on {per_expert_scale.device}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"gemma_route: top_k ({top_k}) must be in 1..{num_experts} (E)")
    if ((logits.is_cuda or _INTERPRETED) and num_experts <= MAX_KERNEL_EXPERTS
            and top_k <= MAX_KERNEL_TOP_K):
        return _gemma_route_op(logits.contiguous(), per_expert_scale.contiguous(), top_k)
    return gemma_route_reference(logits, per_expert_scale, top_k)
