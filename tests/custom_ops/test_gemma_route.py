"""dlmc::gemma_route (DiffusionGemma's softmax top-k routing) against gemma_route_reference.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
The kernel's exp is not torch's bit for bit, so a pick may differ from the reference's only where
the reference's probabilities tie to within rounding (`_assert_routing`); exact ties go to the
lower id in the kernel, in an unspecified order in torch.topk.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import gemma_route as gemma_route_module
from dlmc.custom_ops.gemma_route import gemma_route, gemma_route_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEMMA_26B = (128, 8)  # experts, top_k


def _case(tokens: int, num_experts: int, dtype: torch.dtype, seed: int, scale: float = 2.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [T, E]` in `dtype` and a positive `per_expert_scale [E]` (bf16, as stored)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, num_experts, generator=gen) * scale).to(dtype)
    per_expert_scale = (torch.rand(num_experts, generator=gen) + 0.5).to(torch.bfloat16)
    return logits.to(DEVICE), per_expert_scale.to(DEVICE)


def _assert_routing(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> None:
    ids, weights = gemma_route(logits, per_expert_scale, top_k)
    want_ids, want_weights = gemma_route_reference(logits, per_expert_scale, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    assert (ids.sort(1).values[:, 1:] != ids.sort(1).values[:, :-1]).all(), "an expert twice"
    probs = torch.softmax(logits.double(), dim=-1)  # [T, E]
    same = (ids == want_ids).all(1)  # [T]
    gap = (probs.gather(1, ids) - probs.gather(1, want_ids)).abs().amax(1)  # [T]
    assert (same | (gap <= 1e-6)).all(), f"rows {(~same).nonzero().flatten().tolist()} differ"
    torch.testing.assert_close(weights[same], want_weights[same], rtol=2e-6, atol=1e-9)
    picked = probs.gather(1, ids)  # every row: its own picks' renormalised probabilities
    want = picked / picked.sum(1, keepdim=True) * per_expert_scale.double()[ids]
    torch.testing.assert_close(weights.double(), want, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_diffusion_gemma_routing(dtype: torch.dtype) -> None:
    """DiffusionGemma-26B-A4B's router: 128 experts, top 8, a few canvas rows."""
    _assert_routing(*_case(6, *GEMMA_26B[:1], dtype, seed=1), top_k=GEMMA_26B[1])


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 4), num_experts=st.sampled_from([2, 5, 16, 24, 128, 200]),
       top_k=st.integers(1, 8), dtype=st.sampled_from([torch.bfloat16, torch.float16,
                                                        torch.float32]),
       scale=st.sampled_from([0.01, 1.0, 20.0]), seed=st.integers(0, 2**16))
def test_routing_matches_reference(tokens: int, num_experts: int, top_k: int,
                                   dtype: torch.dtype, scale: float, seed: int) -> None:
    top_k = min(top_k, num_experts)
    _assert_routing(*_case(tokens, num_experts, dtype, seed, scale), top_k)


def test_ties_go_to_the_lower_id_and_keep_their_weights() -> None:
    """Exactly equal logits (bf16 rounding makes them common): the kernel picks the lowest ids
    among the tied, each with the tied probability."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 3.0], [0.0] * 6], device=DEVICE)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], device=DEVICE)
    ids, weights = gemma_route(logits, scale, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 3.0, 5.0], [1.0, 2.0, 3.0]],
                                                     device=DEVICE) / 3)


def test_minus_infinity_logits_are_never_picked_before_finite_ones() -> None:
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0]], device=DEVICE)
    ids, weights = gemma_route(logits, torch.ones(4, device=DEVICE), 2)
    assert ids.tolist() == [[3, 1]]
    probs = torch.softmax(logits[0, [3, 1]], 0)
    torch.testing.assert_close(weights[0], probs)


def test_empty_batch() -> None:
    ids, weights = gemma_route(torch.empty(0, 8, device=DEVICE), torch.ones(8, device=DEVICE), 2)
    assert ids.shape == weights.shape == (0, 2)


def test_large_routings_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemma_route_module, "MAX_KERNEL_EXPERTS", 4)
    logits, scale = _case(3, 8, torch.float32, seed=3)
    got = gemma_route(logits, scale, 2)
    want = gemma_route_reference(logits, scale, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(("logits", "scale", "top_k", "match"), [
    (torch.zeros(4), torch.ones(4), 1, "logits must be a float"),
    (torch.zeros(2, 4, dtype=torch.int32), torch.ones(4), 1, "logits must be a float"),
    (torch.zeros(2, 4), torch.ones(5), 1, r"per_expert_scale must be a float \[E=4\]"),
    (torch.zeros(2, 4), torch.ones(4, dtype=torch.int64), 1, "per_expert_scale"),
    (torch.zeros(2, 4), torch.ones(4), 0, r"top_k \(0\) must be in 1..4"),
    (torch.zeros(2, 4), torch.ones(4), 5, r"top_k \(5\)"),
])
def test_bad_arguments_are_named(logits: torch.Tensor, scale: torch.Tensor, top_k: int,
                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemma_route(logits, scale, top_k)


def test_compiles_and_matches_eager() -> None:
    """Inside torch.compile (the canvas step's compile) the op gives the eager results."""
    logits, scale = _case(4, 16, torch.bfloat16, seed=5)
    compiled = torch.compile(lambda x, s: gemma_route(x * 1.0, s, 4), fullgraph=True)
    got, want = compiled(logits, scale), gemma_route(logits, scale, 4)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=60, deadline=None)
@given(tokens=st.sampled_from([1, 7, 256, 1024]), num_experts=st.sampled_from([8, 100, 128, 512]),
       top_k=st.integers(1, 16), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       scale=st.sampled_from([0.01, 1.0, 20.0]), seed=st.integers(0, 2**16))
def test_routing_matches_reference_gpu(tokens: int, num_experts: int, top_k: int,
                                       dtype: torch.dtype, scale: float, seed: int) -> None:
    _assert_routing(*_case(tokens, num_experts, dtype, seed, scale), min(top_k, num_experts))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_gpu() -> None:
    """Captured in a CUDA graph, a replay over new logits routes them as an eager call does."""
    logits, scale = _case(256, 128, torch.bfloat16, seed=9)
    gemma_route(logits, scale, 8)  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = gemma_route(logits, scale, 8)
    logits.copy_(_case(256, 128, torch.bfloat16, seed=10)[0])
    graph.replay()
    want_ids, want_weights = gemma_route(logits, scale, 8)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
