"""Routing prep for grouped MoE kernels: (token, k) pairs grouped per expert, padded to blocks.

The vLLM `moe_align_block_size` pattern in torch ops only: static shapes, no host sync, so it can
be captured in a CUDA graph and traced by torch.compile.
"""

from __future__ import annotations

import torch


def moe_block_size(num_pairs: int, num_experts: int) -> int:
    """Rows per M-block: 16 (the MMA minimum) for few tokens per expert, up to 64."""
    per_expert = num_pairs // max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs per expert, each expert's segment padded to `block_m` slots.

    Returns `sorted_pair` int32 `[max_blocks * block_m]` (pair id `t*K + k`, or `T*K` for padding)
    and `expert_of_block` int32 `[max_blocks]` (-1 for unused blocks). Torch ops only, static
    shapes, no host sync (CUDA-graph capturable).
    """
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    block_start = block_end - blocks
    seg_start = torch.cumsum(counts, 0) - counts  # [E]
    max_blocks = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    block = torch.arange(max_blocks, device=flat.device)  # [B]
    expert = torch.searchsorted(block_end, block, right=True)  # [B], E when unused
    used = expert < num_experts
    expert_c = expert.clamp(max=num_experts - 1)
    row = (block - block_start[expert_c])[:, None] * block_m + torch.arange(
        block_m, device=flat.device)  # [B, BM] position inside the expert's segment
    valid = used[:, None] & (row < counts[expert_c][:, None])  # [B, BM]
    src = (seg_start[expert_c][:, None] + row).clamp(max=num_pairs - 1)  # [B, BM]
    sorted_pair = torch.where(valid, order[src], num_pairs).to(torch.int32).reshape(-1)
    expert_of_block = torch.where(used, expert, -1).to(torch.int32)  # [B]
    return sorted_pair, expert_of_block


def route_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """`(block_m, sorted_pair, expert_of_block)` for the grouped MoE kernels (see above)."""
    block_m = moe_block_size(topk_ids.numel(), num_experts)
    sorted_pair, expert_of_block = align_pairs_to_blocks(topk_ids, num_experts, block_m)
    return block_m, sorted_pair, expert_of_block


def combine_pairs(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out[t] = sum_k w[t, k] * y[t*K + k]` in fp32: y bf16 `[T*K, H]`, w `[T, K]` -> out."""
    tokens, top_k = topk_weights.shape
    combined = (y.view(tokens, top_k, -1).float() * topk_weights.float()[..., None]).sum(dim=1)
    return out.copy_(combined)
