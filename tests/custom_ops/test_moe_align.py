"""dlmc::moe_align (routing prep): the Triton kernels (one sorting program; one program per
expert above `PER_EXPERT_PAIRS` pairs) against the torch reference, bit for bit.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import moe_align
from dlmc.custom_ops.moe_align import (
    align_pairs_to_blocks,
    align_pairs_to_blocks_reference,
    aligned_blocks,
    append_shared_column,
    moe_block_size,
    route_pairs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens: int, top_k: int, num_experts: int, skew: float, seed: int) -> torch.Tensor:
    """`[T, K]` expert ids, distinct per token when K <= E; skew > 0 piles pairs on low experts."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=gen) ** (1.0 + 20.0 * skew)  # [E]
    if top_k <= num_experts:
        ids = torch.multinomial(popularity.expand(tokens, -1) + 1e-12, top_k, generator=gen)
    else:
        ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    return ids.to(DEVICE)


def _check_invariants(ids: torch.Tensor, num_experts: int, block_m: int,
                      sorted_pair: torch.Tensor, expert_of_block: torch.Tensor,
                      shared_expert: bool = False) -> None:
    """The layout of `align_pairs_to_blocks`; with `shared_expert` that of the [T, K+1] routing
    (expert `num_experts` last in every token) in `aligned_blocks(..., True)` blocks."""
    num_blocks = aligned_blocks(*ids.shape, num_experts, block_m, shared_expert)
    if shared_expert:
        ids, num_experts = append_shared_column(ids, num_experts), num_experts + 1
    num_pairs = ids.numel()
    sorted_pair, expert_of_block = sorted_pair.cpu(), expert_of_block.cpu()
    assert expert_of_block.shape == (num_blocks,)
    assert sorted_pair.shape == (expert_of_block.numel() * block_m,)
    slots = sorted_pair.view(-1, block_m)  # [B, BM]
    real = sorted_pair[sorted_pair < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    assert (sorted_pair <= num_pairs).all()
    flat = ids.reshape(-1).cpu()
    for block, expert in enumerate(expert_of_block.tolist()):
        pairs = slots[block][slots[block] < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and (flat[pairs] == expert).all()
            assert (pairs[1:] > pairs[:-1]).all()  # pair order kept inside the expert
    used = expert_of_block[expert_of_block >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in ascending order, unused blocks last
    assert (expert_of_block[used.numel():] == -1).all()
    counts = torch.bincount(flat, minlength=num_experts)
    assert used.numel() == int(((counts + block_m - 1) // block_m).sum())


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 200), num_experts=st.integers(1, 40), top_k=st.integers(1, 8),
       block_m=st.sampled_from([16, 32, 64]), shared=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_groups_and_pads(tokens: int, num_experts: int, top_k: int, block_m: int,
                                   shared: bool, seed: int) -> None:
    ids = torch.randint(0, num_experts, (tokens, top_k),
                        generator=torch.Generator().manual_seed(seed))
    _check_invariants(ids, num_experts, block_m,
                      *align_pairs_to_blocks_reference(ids, num_experts, block_m, shared), shared)


@settings(max_examples=30 if DEVICE == "cpu" else 60, deadline=None)
@given(tokens=st.integers(1, 512), top_k=st.integers(1, 8), num_experts=st.integers(1, 256),
       block_m=st.sampled_from([16, 32, 64]), skew=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(tokens: int, top_k: int, num_experts: int, block_m: int,
                                  skew: float, seed: int) -> None:
    ids = _routing(tokens, top_k, num_experts, skew, seed)  # T*K in 1..4096
    got = align_pairs_to_blocks(ids, num_experts, block_m)
    want = align_pairs_to_blocks_reference(ids, num_experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check_invariants(ids, num_experts, block_m, *got)


@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "block_m"), [
    (1, 1, 1, 16),  # one pair
    (4096, 1, 1, 64),  # every pair on one expert, 64 full blocks
    (512, 8, 256, 16),  # a full prefill chunk of the 256-expert model
    (32, 8, 256, 16),  # a diffusion block
    (17, 3, 250, 32),  # most experts empty
    (127, 8, 9, 64),
])
def test_kernel_edge_cases(tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    ids = _routing(tokens, top_k, num_experts, skew=1.0, seed=tokens)
    got = align_pairs_to_blocks(ids.int(), num_experts, block_m)  # int32 ids as well
    want = align_pairs_to_blocks_reference(ids, num_experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


TOKENS = st.one_of(st.sampled_from([1, 3, 17, 33]), st.integers(1, 512))


@settings(max_examples=30 if DEVICE == "cpu" else 60, deadline=None)
@given(tokens=TOKENS, top_k=st.integers(1, 8), num_experts=st.integers(1, 256),
       block_m=st.sampled_from([16, 32, 64]), skew=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 2**16))
def test_shared_expert_kernel_matches_reference(tokens: int, top_k: int, num_experts: int,
                                                block_m: int, skew: float, seed: int) -> None:
    ids = _routing(tokens, top_k, num_experts, skew, seed)  # skew: many experts get no pair
    got = align_pairs_to_blocks(ids, num_experts, block_m, shared_expert=True)
    want = align_pairs_to_blocks_reference(ids, num_experts, block_m, shared_expert=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check_invariants(ids, num_experts, block_m, *got, shared_expert=True)


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 96), top_k=st.integers(1, 8), num_experts=st.integers(1, 160),
       block_m=st.sampled_from([16, 32, 64]), skew=st.sampled_from([0.0, 1.0]),
       shared=st.booleans(), seed=st.integers(0, 2**16))
def test_per_expert_programs_match_the_sort(tokens: int, top_k: int, num_experts: int,
                                            block_m: int, skew: float, shared: bool,
                                            seed: int) -> None:
    """Both kernels on the same routings: one program per expert (threshold 0) and one sorting
    program (threshold above every routing here) each equal the reference."""
    ids = _routing(tokens, top_k, num_experts, skew, seed)
    want = align_pairs_to_blocks_reference(ids, num_experts, block_m, shared)
    for threshold in (0, 8192):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_align, "PER_EXPERT_PAIRS", threshold)
            got = align_pairs_to_blocks(ids, num_experts, block_m, shared)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), threshold


def test_canvas_routing_takes_one_program_per_expert() -> None:
    """DiffusionGemma's canvas (256 tokens x top-8 of 128, every pair on few experts included):
    above the threshold, equal to the reference."""
    for skew in (0.0, 1.0):
        ids = _routing(256, 8, 128, skew=skew, seed=5)
        assert ids.numel() > moe_align.PER_EXPERT_PAIRS
        for shared in (False, True):
            got = align_pairs_to_blocks(ids, 128, 16, shared)
            want = align_pairs_to_blocks_reference(ids, 128, 16, shared)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            _check_invariants(ids, 128, 16, *got, shared_expert=shared)


@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "block_m"), [
    (1, 1, 1, 16), (3, 2, 5, 16), (17, 3, 250, 32), (33, 8, 256, 16), (32, 8, 256, 16),
    (127, 8, 9, 64), (512, 8, 256, 32),
])
def test_shared_expert_is_the_appended_column(tokens: int, top_k: int, num_experts: int,
                                              block_m: int) -> None:
    """The dense tail lays out the blocks of today's fused routing (the shared expert's id as
    column K of a [T, K+1] routing over E+1 experts); only the count of unused blocks differs."""
    ids = _routing(tokens, top_k, num_experts, skew=1.0, seed=tokens)
    got = align_pairs_to_blocks(ids, num_experts, block_m, shared_expert=True)
    appended = align_pairs_to_blocks(append_shared_column(ids, num_experts), num_experts + 1,
                                     block_m)
    common = min(got[1].numel(), appended[1].numel())
    assert torch.equal(got[1][:common], appended[1][:common])
    assert torch.equal(got[0][:common * block_m], appended[0][:common * block_m])
    for sorted_pair, expert_of_block in (got, appended):
        assert (expert_of_block[common:] == -1).all()
        assert (sorted_pair[common * block_m:] == tokens * (top_k + 1)).all()


def test_worked_example() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)  # pairs 0..5
    sorted_pair, expert_of_block = align_pairs_to_blocks(ids, 4, 16)  # 1 + min(4, 6) blocks
    expert_0, expert_1, expert_2 = [1, 4] + [6] * 14, [3] + [6] * 15, [0, 2, 5] + [6] * 13
    assert sorted_pair.tolist() == expert_0 + expert_1 + expert_2 + [6] * 32
    assert expert_of_block.tolist() == [0, 1, 2, -1, -1]
    # The shared expert 4 as a dense tail: pair ids t*3 + k, its rows 2, 5, 8; padding 9.
    sorted_pair, expert_of_block = align_pairs_to_blocks(ids, 4, 16, shared_expert=True)
    expert_0, expert_1, expert_2 = [1, 6] + [9] * 14, [4] + [9] * 15, [0, 3, 7] + [9] * 13
    shared = [2, 5, 8] + [9] * 13
    assert sorted_pair.tolist() == expert_0 + expert_1 + expert_2 + shared + [9] * 32
    assert expert_of_block.tolist() == [0, 1, 2, 4, -1, -1]


def test_large_routings_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _routing(40, 8, 64, skew=0.0, seed=1)
    calls = []

    def reference(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args)
        return align_pairs_to_blocks_reference(*args)

    monkeypatch.setattr(moe_align, "align_pairs_to_blocks_reference", reference)
    block_m, sorted_pair, expert_of_block = route_pairs(ids, 64)
    assert block_m == moe_block_size(ids.numel(), 64) == 16 and not calls  # the kernel
    monkeypatch.setattr(moe_align, "MAX_KERNEL_PAIRS", ids.numel() - 1)
    assert torch.equal(route_pairs(ids, 64)[1], sorted_pair) and len(calls) == 1
    monkeypatch.setattr(moe_align, "MAX_KERNEL_PAIRS", ids.numel())
    monkeypatch.setattr(moe_align, "MAX_KERNEL_EXPERTS", 63)
    assert torch.equal(route_pairs(ids, 64)[2], expert_of_block) and len(calls) == 2


def test_route_pairs_takes_a_given_block_m() -> None:
    ids = _routing(40, 8, 64, skew=0.0, seed=3)
    block_m, sorted_pair, expert_of_block = route_pairs(ids, 64, block_m=32)
    want = align_pairs_to_blocks_reference(ids, 64, 32, False)
    assert block_m == 32 and torch.equal(sorted_pair, want[0])
    assert torch.equal(expert_of_block, want[1])
    with pytest.raises(ValueError, match="block_m must be 16, 32 or 64, got 24"):
        route_pairs(ids, 64, block_m=24)


@pytest.mark.parametrize("shared_expert", [False, True])
def test_opcheck(shared_expert: bool) -> None:
    ids = _routing(9, 4, 12, skew=0.5, seed=2)
    torch.library.opcheck(torch.ops.dlmc.moe_align.default, (ids, 12, 16, shared_expert),
                          test_utils=("test_schema", "test_faketensor"))


def test_block_size() -> None:
    assert moe_block_size(32 * 8, 256) == 16
    assert moe_block_size(300 * 2, 4) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("shared_expert", [False, True])
def test_compile_and_graph_replay(shared_expert: bool) -> None:
    ids = _routing(512, 8, 256, skew=0.5, seed=3)
    fn = torch.compile(lambda t: align_pairs_to_blocks(t, 256, 16, shared_expert),
                       fullgraph=True)
    fn(ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_pair, expert_of_block = fn(ids)
    ids.copy_(_routing(512, 8, 256, skew=1.0, seed=4))
    graph.replay()
    want = align_pairs_to_blocks_reference(ids, 256, 16, shared_expert)
    assert torch.equal(sorted_pair, want[0]) and torch.equal(expert_of_block, want[1])
