"""dlmc::moe_route_align against the two ops it fuses (moe_route, then moe_align), bit for bit.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py):
few examples, small shapes. The fused program shares `route_tokens` and `align_pairs` with the two
ops, so its four results are `torch.equal` to theirs even on ties and NaN logits; against the
torch reference the routing agrees as in test_moe_route.py and the alignment bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import moe_route_align as fused_module
from dlmc.custom_ops.moe_align import (
    align_pairs_to_blocks,
    align_pairs_to_blocks_reference,
    aligned_blocks,
    route_block_m,
    route_pairs,
)
from dlmc.custom_ops.moe_route import moe_route
from dlmc.custom_ops.moe_route_align import (
    fused_kernel_applies,
    moe_route_align,
    moe_route_align_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLADA21_MINI = (8, 4, 8, True, 2.5)  # n_group, topk_group, top_k, norm_topk_prob, scaling
EXTREMES = torch.tensor([-1e4, -30.0, 30.0, 1e4])  # saturated sigmoids: exact ties


def _case(tokens: int, num_experts: int, seed: int, splits: int = 0, extreme: bool = False,
          nan: bool = False, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits (`[T, E]`, or `[S, T, E]` partials for splits > 0) and `expert_bias [E]`;
    extreme puts a third of the logits at +-30 / +-1e4, nan a tenth at NaN."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(max(splits, 1), tokens, num_experts, generator=gen)
    if extreme:
        picks = EXTREMES[torch.randint(0, 4, logits.shape, generator=gen)]
        logits = torch.where(torch.rand(logits.shape, generator=gen) < 1 / 3, picks, logits)
    if nan:
        logits = torch.where(torch.rand(logits.shape, generator=gen) < 0.1, float("nan"), logits)
    expert_bias = torch.randn(num_experts, generator=gen) * 0.1 * bias
    return (logits if splits else logits[0]).to(DEVICE), expert_bias.to(DEVICE)


def _two_ops(logits: torch.Tensor, expert_bias: torch.Tensor, config: tuple,
             shared_expert: bool) -> tuple[torch.Tensor, ...]:
    """What the model ran before: `moe_route`, then `route_pairs` (in the experts)."""
    ids, weights = moe_route(logits, expert_bias, *config)
    return ids, weights, *route_pairs(ids, logits.shape[-1], shared_expert)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal`, with NaN weights (NaN logits) compared by their bit patterns."""
    if a.dtype == b.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


def _assert_fused_equals_two_ops(logits: torch.Tensor, expert_bias: torch.Tensor, config: tuple,
                                 shared_expert: bool) -> None:
    ids, weights, routing = moe_route_align(logits, expert_bias, *config, shared_expert)
    want = _two_ops(logits, expert_bias, config, shared_expert)
    tokens, num_experts, top_k = logits.shape[-2], logits.shape[-1], config[2]
    assert routing.block_m == want[2] == route_block_m(tokens, top_k, num_experts, shared_expert)
    num_blocks = aligned_blocks(tokens, top_k, num_experts, routing.block_m, shared_expert)
    assert routing.expert_of_block.shape == (num_blocks,)
    got = (ids, weights, routing.block_m, routing.sorted_pair, routing.expert_of_block)
    for name, a, b in zip(("ids", "weights", "block_m", "sorted_pair", "expert_of_block"), got,
                          want, strict=True):
        assert a == b if name == "block_m" else _same_bits(a, b), name
    # the alignment is that of the routing it returned, as the torch reference makes it
    ref_pair, ref_block = align_pairs_to_blocks_reference(ids, num_experts, routing.block_m,
                                                          shared_expert)
    assert torch.equal(routing.sorted_pair, ref_pair)
    assert torch.equal(routing.expert_of_block, ref_block)


@settings(max_examples=12 if DEVICE == "cpu" else 80, deadline=None)
@given(tokens=st.integers(1, 64), shape=st.sampled_from([(8, 4), (64, 8), (256, 8), (256, 4),
                                                         (12, 3)]),
       data=st.data(), splits=st.sampled_from([0, 1, 3]), norm=st.booleans(),
       extreme=st.booleans(), nan=st.booleans(), bias=st.booleans(), shared=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_equals_route_then_align(tokens: int, shape: tuple[int, int], data: st.DataObject,
                                       splits: int, norm: bool, extreme: bool, nan: bool,
                                       bias: bool, shared: bool, seed: int) -> None:
    num_experts, n_group = shape
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    kept = topk_group * (num_experts // n_group)
    top_k = data.draw(st.integers(1, min(kept, 16)), label="top_k")
    logits, expert_bias = _case(tokens, num_experts, seed, splits, extreme, nan, bias)
    assert fused_kernel_applies(logits, n_group, top_k)
    config = (n_group, topk_group, top_k, norm, 2.5)
    _assert_fused_equals_two_ops(logits, expert_bias, config, shared)


@pytest.mark.parametrize(("tokens", "num_experts", "config", "splits", "shared"), [
    (32, 256, LLADA21_MINI, 0, False),  # a diffusion block of LLaDA2.1-mini, cuBLAS logits
    (32, 256, LLADA21_MINI, 4, True),  # ... router_gemm's split-K partials, shared expert fused
    (64, 256, LLADA21_MINI, 0, True),  # the largest block of the one program at E = 256
    (1, 256, LLADA21_MINI, 0, False),
    (3, 40, (5, 5, 16, False, 1.0), 0, True),  # every group kept, the largest top_k
])
def test_llada2_shapes(tokens: int, num_experts: int, config: tuple, splits: int,
                       shared: bool) -> None:
    for extreme in (False, True):  # saturated sigmoids: exact ties
        logits, expert_bias = _case(tokens, num_experts, seed=tokens, splits=splits,
                                    extreme=extreme)
        _assert_fused_equals_two_ops(logits, expert_bias, config, shared)


def test_ties_go_to_the_lower_index() -> None:
    # 8 experts in 4 groups of 2, every score 0.5: groups 0, 1 kept, experts 0, 1, 2 picked.
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, 6] = 1.0  # token 1: group 3 wins, its expert 6 first, then the ties in order
    ids, _, (block_m, sorted_pair, expert_of_block) = moe_route_align(
        logits, torch.zeros(8, device=DEVICE), 4, 2, 3, True, 3.0, shared_expert=True)
    assert ids.tolist() == [[0, 1, 2], [6, 0, 1]]
    assert block_m == 16
    # experts 0, 1, 2, 6 (pairs t*4 + k), then the shared expert 8 (pairs t*4 + 3); padding 8
    assert expert_of_block.tolist()[:5] == [0, 1, 2, 6, 8]
    blocks = sorted_pair.view(-1, 16)[:5, :2].tolist()
    assert blocks == [[0, 5], [1, 6], [2, 8], [4, 8], [3, 7]]


def test_beyond_the_limits_runs_the_two_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, expert_bias = _case(17, 64, seed=5)
    calls = []
    op = fused_module._moe_route_align_op
    monkeypatch.setattr(fused_module, "_moe_route_align_op",
                        lambda *a: calls.append(a) or op(*a))
    want = moe_route_align(logits, expert_bias, *LLADA21_MINI, True)
    assert len(calls) == 1
    for limit, value in (("MAX_FUSED_TILE", 16 * 64), ("MAX_WARPS", 32)):
        with monkeypatch.context() as patch:
            patch.setattr(fused_module, limit, value)
            got = moe_route_align(logits, expert_bias, *LLADA21_MINI, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert all(torch.equal(a, b) for a, b in zip(got[2][1:], want[2][1:], strict=True))
    assert len(calls) == 2  # the tile limit fell back, the warp cap did not
    from dlmc.custom_ops import moe_align as align_module

    with monkeypatch.context() as patch:
        patch.setattr(align_module, "MAX_KERNEL_PAIRS", 17 * 8 - 1)
        assert not fused_kernel_applies(logits, 8, 8)
    if DEVICE == "cpu":  # a CPU without the interpreter: the torch maths, same shapes
        monkeypatch.setattr(fused_module, "_INTERPRETED", False)
        ids, weights, routing = moe_route_align(logits, expert_bias, *LLADA21_MINI, True)
        ref = moe_route_align_reference(logits, expert_bias, *LLADA21_MINI, True)
        assert torch.equal(ids, ref[0]) and routing.block_m == ref[2].block_m
        assert routing.sorted_pair.shape == want[2].sorted_pair.shape
    assert len(calls) == 2


def test_reference_is_route_then_align() -> None:
    logits, expert_bias = _case(9, 64, seed=6, splits=2)
    ids, weights, routing = moe_route_align_reference(logits, expert_bias, *LLADA21_MINI)
    assert routing.block_m == route_block_m(9, 8, 64)
    want = align_pairs_to_blocks(ids, 64, routing.block_m)
    assert torch.equal(routing.sorted_pair, want[0])
    assert torch.equal(routing.expert_of_block, want[1])


def test_empty_block() -> None:
    ids, weights, routing = moe_route_align(torch.empty(0, 16, device=DEVICE),
                                            torch.zeros(16, device=DEVICE), 4, 2, 4, True, 1.0)
    assert ids.shape == weights.shape == (0, 4)
    assert routing.sorted_pair.numel() == routing.expert_of_block.numel() == 0


def test_bad_input_is_named() -> None:
    logits, expert_bias = _case(2, 16, seed=1)
    with pytest.raises(ValueError, match="moe_route_align: logits must be fp32"):
        moe_route_align(logits.bfloat16(), expert_bias, 4, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match=r"moe_route_align: top_k \(9\) must be in 1..2 kept"):
        moe_route_align(logits, expert_bias, 4, 2, 9, True, 1.0)


def test_opcheck() -> None:
    logits, expert_bias = _case(5, 16, seed=2, splits=2)
    for shared in (False, True):
        torch.library.opcheck(torch.ops.dlmc.moe_route_align.default,
                              (logits, expert_bias, 4, 2, 4, True, 2.5, 16, shared),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_compile_and_graph_replay(shared: bool) -> None:
    logits, expert_bias = _case(32, 256, seed=3, splits=8)
    fn = torch.compile(lambda t, b: moe_route_align(t, b, *LLADA21_MINI, shared), fullgraph=True)
    fn(logits, expert_bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights, routing = fn(logits, expert_bias)
    new_logits, new_bias = _case(32, 256, seed=4, splits=8, extreme=True)
    logits.copy_(new_logits)
    expert_bias.copy_(new_bias)
    graph.replay()
    want = _two_ops(logits, expert_bias, LLADA21_MINI, shared)
    assert torch.equal(ids, want[0]) and _same_bits(weights, want[1])
    assert routing.block_m == want[2]
    assert torch.equal(routing.sorted_pair, want[3])
    assert torch.equal(routing.expert_of_block, want[4])
