"""Routing prep: every (token, k) pair lands in exactly one slot of a block of its expert."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.moe_align import align_pairs_to_blocks, moe_block_size


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 200), num_experts=st.integers(1, 40), top_k=st.integers(1, 8),
       block_m=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**16))
def test_pairs_grouped_and_padded(tokens: int, num_experts: int, top_k: int, block_m: int,
                                  seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    sorted_pair, expert_of_block = align_pairs_to_blocks(ids, num_experts, block_m)
    num_pairs = tokens * top_k
    assert sorted_pair.shape == (expert_of_block.numel() * block_m,)
    slots = sorted_pair.view(-1, block_m)  # [B, BM]
    real = sorted_pair[sorted_pair < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    assert (sorted_pair <= num_pairs).all()
    flat = ids.reshape(-1)
    for block, expert in enumerate(expert_of_block.tolist()):
        pairs = slots[block][slots[block] < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and (flat[pairs] == expert).all()
    used = expert_of_block[expert_of_block >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in ascending order, unused blocks last
    counts = torch.bincount(flat, minlength=num_experts)
    assert used.numel() == int(((counts + block_m - 1) // block_m).sum())


def test_block_size() -> None:
    assert moe_block_size(32 * 8, 256) == 16
    assert moe_block_size(300 * 2, 4) == 64
