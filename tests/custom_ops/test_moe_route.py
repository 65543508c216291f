"""dlmc::moe_route (router top-k after the GEMM) against moe_route_reference.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
which is slow: few examples, small shapes. The kernel's sigmoid is not torch's bit for bit (up to
2 ulp apart), so a pick may differ from the reference's only where the reference's biased scores
tie to within rounding (`_assert_routing`); exact ties go to the lower index in both.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import moe_route as moe_route_module
from dlmc.custom_ops.moe_route import moe_route, moe_route_reference

# The interpreter's sigmoid of -1e4 overflows exp() to inf on the way to an exact 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLADA21_MINI = (8, 4, 8, True, 2.5)  # n_group, topk_group, top_k, norm_topk_prob, scaling
EXTREMES = torch.tensor([-1e4, -30.0, 30.0, 1e4])  # sigmoid exactly 0 / tiny / exactly 1


def _case(tokens: int, num_experts: int, seed: int, scale: float = 1.0, extreme: bool = False,
          bias: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `logits [T, E]` and `expert_bias [E]`; extreme puts a third of the logits at
    +-30 / +-1e4 (saturated sigmoids: exact ties when the bias is off)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen) * scale
    if extreme:
        picks = EXTREMES[torch.randint(0, 4, logits.shape, generator=gen)]
        logits = torch.where(torch.rand(logits.shape, generator=gen) < 1 / 3, picks, logits)
    expert_bias = torch.randn(num_experts, generator=gen) * 0.1 * bias
    return logits.to(DEVICE), expert_bias.to(DEVICE)


def _weights_of(ids: torch.Tensor, logits: torch.Tensor, norm: bool, scale: float) -> torch.Tensor:
    weights = torch.sigmoid(logits).gather(1, ids)  # [T, K]
    return (weights / (weights.sum(-1, keepdim=True) + 1e-20) if norm else weights) * scale


def _assert_routing(logits: torch.Tensor, expert_bias: torch.Tensor, n_group: int,
                    topk_group: int, top_k: int, norm: bool, scale: float) -> None:
    args = (n_group, topk_group, top_k, norm, scale)
    ids, weights = moe_route(logits, expert_bias, *args)
    want_ids, want_weights = moe_route_reference(logits, expert_bias, *args)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    same = (ids == want_ids).all(1)  # [T]
    biased = torch.sigmoid(logits.double()) + expert_bias.double()  # [T, E]
    gap = (biased.gather(1, ids) - biased.gather(1, want_ids)).abs().amax(1)  # [T]
    assert (same | (gap <= 1e-6)).all(), f"rows {(~same).nonzero().flatten().tolist()} differ"
    torch.testing.assert_close(weights[same], want_weights[same], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(weights, _weights_of(ids, logits, norm, scale), rtol=1e-6,
                               atol=1e-12)


# (E, n_group): groups of 1, 2, 8, 32 and 64 experts.
SHAPES = [(8, 1), (8, 4), (8, 8), (64, 1), (64, 8), (256, 8), (256, 4)]


@settings(max_examples=12 if DEVICE == "cpu" else 60, deadline=None)  # GPU: shapes compile
@given(tokens=st.sampled_from([1, 3, 17, 32, 127]), shape=st.sampled_from(SHAPES),
       data=st.data(), norm=st.booleans(), scale=st.sampled_from([1.0, 2.5]),
       logit_scale=st.sampled_from([0.5, 2.0]), extreme=st.booleans(), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(tokens: int, shape: tuple[int, int], data: st.DataObject,
                                  norm: bool, scale: float, logit_scale: float, extreme: bool,
                                  bias: bool, seed: int) -> None:
    num_experts, n_group = shape
    if DEVICE == "cpu" and tokens * num_experts > 32 * 256:  # interpreter time
        tokens = 32
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    kept = topk_group * (num_experts // n_group)
    top_k = data.draw(st.integers(1, min(kept, moe_route_module.MAX_KERNEL_TOP_K)), label="top_k")
    logits, expert_bias = _case(tokens, num_experts, seed, logit_scale, extreme, bias)
    _assert_routing(logits, expert_bias, n_group, topk_group, top_k, norm, scale)


@pytest.mark.parametrize(("tokens", "num_experts", "config"), [
    (32, 256, LLADA21_MINI),  # a diffusion block of LLaDA2.1-mini
    (127, 64, (8, 4, 8, True, 2.5)),
    (3, 12, (3, 2, 5, False, 1.0)),  # E and n_group not powers of two
    (5, 40, (5, 5, 16, True, 1.0)),  # every group kept, the largest kernel top_k
    (1, 8, (1, 1, 8, True, 1.0)),  # one group, every expert picked
])
def test_edge_cases(tokens: int, num_experts: int, config: tuple) -> None:
    for extreme in (False, True):
        _assert_routing(*_case(tokens, num_experts, seed=tokens, extreme=extreme), *config)


def test_ties_go_to_the_lower_index_in_descending_order() -> None:
    # 8 experts in 4 groups of 2, every score 0.5: groups 0 and 1 kept, experts 0, 1, 2 picked.
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, 6] = 1.0  # token 1: group 3 wins, its expert 6 first, then the ties in order
    expert_bias = torch.zeros(8, device=DEVICE)
    for route in (moe_route, moe_route_reference):
        ids, weights = route(logits, expert_bias, 4, 2, 3, True, 3.0)
        assert ids.tolist() == [[0, 1, 2], [6, 0, 1]]
        s = torch.sigmoid(torch.tensor(1.0)).item()
        want = torch.tensor([[1.0, 1.0, 1.0], [3 * s / (s + 1), 1.5 / (s + 1), 1.5 / (s + 1)]])
        torch.testing.assert_close(weights.cpu(), want)


def test_negative_biased_scores_and_their_ties_keep_the_order() -> None:
    # Biased scores all below zero (sigmoid - 3, no -inf): negative values ordered by value
    # (order keys of such values must flip their bits), equal logits tied to the lower index.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (9, 64), generator=gen).float().to(DEVICE) / 2  # many ties
    expert_bias = torch.full((64,), -3.0, device=DEVICE)
    expert_bias[::7] = -2.5
    for config in ((8, 3, 8, True, 2.5), (1, 1, 16, False, 1.0), (64, 5, 5, True, 1.0)):
        ids, weights = moe_route(logits, expert_bias, *config)
        want_ids, want_weights = moe_route_reference(logits, expert_bias, *config)
        assert ids.tolist() == want_ids.tolist()
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_bias_selects_but_does_not_weight() -> None:
    # 16 experts in 4 groups of 4, keep 2 groups, top 4: group 3 wins through the bias alone.
    logits = torch.full((1, 16), -4.0, device=DEVICE)
    logits[0, [0, 1]], logits[0, [4, 5]], logits[0, 8] = 3.0, 2.0, 4.0
    expert_bias = torch.zeros(16, device=DEVICE)
    expert_bias[[12, 13]] = 10.0
    ids, weights = moe_route(logits, expert_bias, 4, 2, 4, False, 1.0)
    assert ids.tolist() == [[12, 13, 0, 1]]
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, [12, 13, 0, 1]]))


def test_empty_and_large_routings_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = moe_route(torch.empty(0, 8, device=DEVICE), torch.zeros(8, device=DEVICE),
                      2, 1, 2, True, 1.0)
    assert empty[0].shape == empty[1].shape == (0, 2)
    logits, expert_bias = _case(3, 64, seed=7)
    calls = []

    def reference(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args)
        return moe_route_reference(*args)

    monkeypatch.setattr(moe_route_module, "moe_route_reference", reference)
    kernel = moe_route(logits, expert_bias, *LLADA21_MINI)
    assert not calls
    partials = torch.stack([logits * 0.5, logits * 0.5])  # [S=2, T, E], sums exactly to logits
    for limit, value in (("MAX_KERNEL_EXPERTS", 63), ("MAX_KERNEL_TOP_K", 7)):
        with monkeypatch.context() as patch:
            patch.setattr(moe_route_module, limit, value)
            assert torch.equal(moe_route(logits, expert_bias, *LLADA21_MINI)[0], kernel[0])
            # the limits apply to E (the last dim) for partials too, not to T
            assert torch.equal(moe_route(partials, expert_bias, *LLADA21_MINI)[0], kernel[0])
    if DEVICE == "cpu":  # a CPU without the interpreter
        monkeypatch.setattr(moe_route_module, "_INTERPRETED", False)
        moe_route(logits, expert_bias, *LLADA21_MINI)
    assert len(calls) == (5 if DEVICE == "cpu" else 4)


def test_bad_input_is_named() -> None:
    logits, expert_bias = _case(2, 16, seed=1)
    with pytest.raises(ValueError, match="logits must be fp32"):
        moe_route(logits.bfloat16(), expert_bias, 4, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match=r"expert_bias must be fp32 \[E=16\]"):
        moe_route(logits, expert_bias[:8], 4, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match=r"n_group \(3\) must divide E \(16\)"):
        moe_route(logits, expert_bias, 3, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match=r"top_k \(9\) must be in 1..2 kept groups x 4"):
        moe_route(logits, expert_bias, 4, 2, 9, True, 1.0)


def test_opcheck() -> None:
    logits, expert_bias = _case(5, 16, seed=2)
    torch.library.opcheck(torch.ops.dlmc.moe_route.default,
                          (logits, expert_bias, 4, 2, 4, True, 2.5),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_graph_replay() -> None:
    logits, expert_bias = _case(32, 256, seed=3)
    fn = torch.compile(lambda t, b: moe_route(t, b, *LLADA21_MINI), fullgraph=True)
    fn(logits, expert_bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = fn(logits, expert_bias)
    new_logits, new_bias = _case(32, 256, seed=4, extreme=True)
    logits.copy_(new_logits)
    expert_bias.copy_(new_bias)
    graph.replay()
    want = moe_route(logits, expert_bias, *LLADA21_MINI)
    assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])
    _assert_routing(logits, expert_bias, *LLADA21_MINI)
