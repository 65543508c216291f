"""dlmc::moe_route_last_align against the two ops it folds (moe_route, then moe_align), bit for
bit, and its ticket back at 0 after every call.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
which runs the programs one after another: the last ticket goes to the last program. On the GPU
the programs race for the tickets (the GPU tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import moe_route_last_align as last_module
from dlmc.custom_ops.moe_align import align_pairs_to_blocks_reference, route_block_m, route_pairs
from dlmc.custom_ops.moe_route import moe_route
from dlmc.custom_ops.moe_route_last_align import last_align_applies, moe_route_last_align

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLADA21_MINI = (8, 4, 8, True, 2.5)  # n_group, topk_group, top_k, norm_topk_prob, scaling


def _case(tokens: int, num_experts: int, seed: int,
          splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits (`[T, E]`, or `[S, T, E]` split-K partials) and `expert_bias [E]`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(max(splits, 1), tokens, num_experts, generator=gen)
    expert_bias = torch.randn(num_experts, generator=gen) * 0.1
    return (logits if splits else logits[0]).to(DEVICE), expert_bias.to(DEVICE)


def _ticket() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _assert_equals_two_ops(logits: torch.Tensor, expert_bias: torch.Tensor, config: tuple,
                           shared: bool, ticket: torch.Tensor) -> None:
    ids, weights, routing = moe_route_last_align(logits, expert_bias, ticket, *config, shared)
    want_ids, want_weights = moe_route(logits, expert_bias, *config)
    want = route_pairs(want_ids, logits.shape[-1], shared)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights.view(torch.int32), want_weights.view(torch.int32))
    assert routing.block_m == want.block_m == route_block_m(logits.shape[-2], config[2],
                                                            logits.shape[-1], shared)
    assert torch.equal(routing.sorted_pair, want.sorted_pair)
    assert torch.equal(routing.expert_of_block, want.expert_of_block)
    ref_pair, ref_block = align_pairs_to_blocks_reference(ids, logits.shape[-1], routing.block_m,
                                                          shared)
    assert torch.equal(routing.sorted_pair, ref_pair)
    assert torch.equal(routing.expert_of_block, ref_block)
    assert ticket.item() == 0  # left ready for the next launch


@settings(max_examples=8 if DEVICE == "cpu" else 80, deadline=None)
@given(tokens=st.integers(1, 40), shape=st.sampled_from([(8, 4), (64, 8), (256, 8), (12, 3)]),
       data=st.data(), splits=st.sampled_from([0, 3]), norm=st.booleans(),
       shared=st.booleans(), seed=st.integers(0, 2**16))
def test_equals_route_then_align(tokens: int, shape: tuple[int, int], data: st.DataObject,
                                 splits: int, norm: bool, shared: bool, seed: int) -> None:
    num_experts, n_group = shape
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    top_k = data.draw(st.integers(1, min(topk_group * (num_experts // n_group), 16)),
                      label="top_k")
    logits, expert_bias = _case(tokens, num_experts, seed, splits)
    assert last_align_applies(logits, top_k)
    _assert_equals_two_ops(logits, expert_bias, (n_group, topk_group, top_k, norm, 2.5), shared,
                           _ticket())


@pytest.mark.parametrize(("tokens", "splits", "shared"), [(32, 0, False), (32, 4, True),
                                                          (1, 0, True)])
def test_llada2_shapes_and_one_ticket_for_many_calls(tokens: int, splits: int,
                                                     shared: bool) -> None:
    ticket = _ticket()
    for seed in range(2):  # the same ticket twice: each launch leaves it at 0
        logits, expert_bias = _case(tokens, 256, seed=seed, splits=splits)
        _assert_equals_two_ops(logits, expert_bias, LLADA21_MINI, shared, ticket)


def test_beyond_the_limits_runs_the_two_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlmc.custom_ops import moe_align as align_module

    logits, expert_bias = _case(9, 64, seed=4)
    want = moe_route_last_align(logits, expert_bias, _ticket(), *LLADA21_MINI, True)
    monkeypatch.setattr(align_module, "MAX_KERNEL_PAIRS", 9 * 8 - 1)
    assert not last_align_applies(logits, 8)
    calls = []
    monkeypatch.setattr(last_module, "_moe_route_last_align_op", lambda *a: calls.append(a))
    got = moe_route_last_align(logits, expert_bias, _ticket(), *LLADA21_MINI, True)
    assert not calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[2].sorted_pair, want[2].sorted_pair)


def test_empty_block() -> None:
    ids, weights, routing = moe_route_last_align(torch.empty(0, 16, device=DEVICE),
                                                 torch.zeros(16, device=DEVICE), _ticket(), 4,
                                                 2, 4, True, 1.0)
    assert ids.shape == weights.shape == (0, 4)
    assert routing.sorted_pair.numel() == routing.expert_of_block.numel() == 0


def test_bad_input_is_named() -> None:
    logits, expert_bias = _case(2, 16, seed=1)
    with pytest.raises(ValueError, match=r"moe_route_last_align: ticket must be int32 \[1\]"):
        moe_route_last_align(logits, expert_bias, torch.zeros(1, device=DEVICE), 4, 2, 4, True,
                             1.0)
    with pytest.raises(ValueError, match="moe_route_last_align: logits must be fp32"):
        moe_route_last_align(logits.bfloat16(), expert_bias, _ticket(), 4, 2, 4, True, 1.0)


def test_opcheck() -> None:
    logits, expert_bias = _case(5, 16, seed=2, splits=2)
    for shared in (False, True):
        torch.library.opcheck(torch.ops.dlmc.moe_route_last_align.default,
                              (logits, expert_bias, _ticket(), 4, 2, 4, True, 2.5, 16, shared),
                              test_utils=("test_schema", "test_faketensor"))


def test_compiled_fullgraph_keeps_the_ticket_in_place() -> None:
    """torch.compile (fullgraph; the op is opaque under the interpreter) with the ticket a
    mutated input: the same results as eager, the ticket the caller holds back at 0."""
    logits, expert_bias = _case(6, 16, seed=7, splits=2)
    ticket = _ticket()
    fn = torch.compile(lambda t, b: moe_route_last_align(t, b, ticket, 4, 2, 4, True, 2.5, True),
                       fullgraph=True)
    ids, weights, routing = fn(logits, expert_bias)
    want = moe_route_last_align(logits, expert_bias, _ticket(), 4, 2, 4, True, 2.5, True)
    assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])
    assert torch.equal(routing.sorted_pair, want[2].sorted_pair)
    assert ticket.tolist() == [0]


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_compile_and_graph_replay(shared: bool) -> None:
    """Compiled (fullgraph) and graph-replayed with new logits copied in: the programs race for
    the tickets, the results still equal the two ops and the ticket is back at 0 each time."""
    logits, expert_bias = _case(32, 256, seed=3, splits=8)
    ticket = _ticket()
    fn = torch.compile(lambda t, b: moe_route_last_align(t, b, ticket, *LLADA21_MINI, shared),
                       fullgraph=True)
    fn(logits, expert_bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights, routing = fn(logits, expert_bias)
    for seed in range(20):
        logits.copy_(_case(32, 256, seed=100 + seed, splits=8)[0])
        graph.replay()
        torch.cuda.synchronize()
        want_ids, _ = moe_route(logits, expert_bias, *LLADA21_MINI)
        want = route_pairs(want_ids, 256, shared)
        assert torch.equal(ids, want_ids)
        assert torch.equal(routing.sorted_pair, want.sorted_pair)
        assert torch.equal(routing.expert_of_block, want.expert_of_block)
        assert ticket.item() == 0
