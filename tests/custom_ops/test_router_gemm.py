"""dlmc::router_gemm (split-K partials of the router's fp32 GEMM on BF16 tensor cores) against
`x.float() @ W^T`, and dlmc::moe_route summing those partials.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
where its dots are widened to fp32 but the three-way bf16 split of the weight is the real one.
The products are exact, so the sum of the partials agrees with the fp32 GEMM to fp32
summation-order level: a few ulps of the sum of |products|.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlmc.custom_ops.router_gemm as router_gemm_module
from dlmc.custom_ops.moe_route import moe_route, moe_route_reference
from dlmc.custom_ops.router_gemm import router_gemm, router_gemm_reference, router_splits

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLADA21_MINI = (8, 4, 8, True, 2.5)  # n_group, topk_group, top_k, norm_topk_prob, scaling


def make_case(tokens: int, features: int, inner: int, seed: int,
              magnitudes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 `x [T, K]` and an fp32 `weight [N, K]` with all 24 significand bits in use;
    `magnitudes` scales each weight row by 2^-100 .. 2^100 (tiny and large rows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inner, generator=gen).bfloat16()
    weight = torch.randn(features, inner, generator=gen) * inner**-0.5
    if magnitudes:
        weight *= torch.exp2(torch.randint(-100, 101, (features, 1), generator=gen).float())
    return x.to(DEVICE), weight.to(DEVICE)


def assert_logits(partial: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The partials sum to `x.float() @ W^T` within 2^-18 (~4e-6) of the sum of |products|."""
    splits, _ = router_splits(weight.shape[1])
    assert partial.shape == (splits, x.shape[0], weight.shape[0])
    assert partial.dtype == torch.float32
    want = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    error = (partial.double().sum(0) - want).abs()
    assert (error <= 2**-18 * magnitude).all(), f"max rel {(error / magnitude).max():.2e}"
    fp32 = x.float() @ weight.t()  # the fp32 GEMM: the same level from the exact sum
    assert ((fp32.double() - want).abs() <= 2**-18 * magnitude).all()


@settings(max_examples=10, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 64]), features=st.sampled_from([16, 40, 256]),
       inner=st.sampled_from([16, 130, 512, 2048]), magnitudes=st.booleans(),
       seed=st.integers(0, 2**16))
def test_partials_sum_to_the_fp32_gemm(tokens: int, features: int, inner: int, magnitudes: bool,
                                       seed: int) -> None:
    if DEVICE == "cpu" and tokens * features * inner > 32 * 256 * 512:  # interpreter time
        tokens = 3
    x, weight = make_case(tokens, features, inner, seed, magnitudes)
    partial = router_gemm(x, weight)
    assert_logits(partial, x, weight)
    torch.testing.assert_close(partial, router_gemm_reference(x, weight), rtol=1e-5,
                               atol=1e-5 * weight.abs().max().item())


def test_router_shape_and_weight_edge_cases() -> None:
    """LLaDA2.1-mini's router; rows of bf16-exact, tiny (2^-100), large (2^100) and mixed
    weights, and zeros: the split into hi + mid + lo is exact for all of them."""
    x, weight = make_case(32, 256, 2048, 0)
    weight[0] = weight[0].bfloat16().float()  # mid = lo = 0
    weight[1] *= 2.0**-100
    weight[2] *= 2.0**100
    weight[3, ::2] *= 2.0**-60  # tiny and ordinary weights in one row
    weight[4] = 0.0
    partial = router_gemm(x, weight)
    assert_logits(partial, x, weight)
    assert (partial[:, :, 4] == 0).all()


def test_the_weight_split_is_exact() -> None:
    """One-hot tokens pick single weights: their logits are the weights bit for bit (a dropped
    or rounded `mid` / `lo` would show) for 2^-103 <= |w| < 2^121. Below, a part under bf16's
    smallest normal 2^-126 may be flushed (the interpreter does): error < 2^-124."""
    inner, features = 512, 64
    gen = torch.Generator().manual_seed(5)
    picks = torch.randint(0, inner, (17,), generator=gen)
    x = torch.zeros(17, inner).index_put_((torch.arange(17), picks), torch.tensor(1.0))
    x = x.bfloat16().to(DEVICE)
    sign = torch.randint(0, 2, (features, inner), generator=gen) * 2.0 - 1.0
    weight = sign * (1.0 + torch.rand(features, inner, generator=gen))  # |w| in [1, 2)
    weight = (weight * torch.exp2(torch.linspace(-103, 120, features).round())[:, None])
    weight = weight.to(DEVICE)
    logits = router_gemm(x, weight).sum(0)  # [T, N]
    assert torch.equal(logits, weight[:, picks.to(DEVICE)].t())
    weight *= torch.exp2(-torch.linspace(0, 40, features, device=DEVICE).round())[:, None]
    weight[0, :] = 1e-40  # fp32 subnormals
    logits = router_gemm(x, weight).sum(0)
    tiny = weight.abs() < 2.0**-103
    exact = ~tiny[:, picks.to(DEVICE)].t()
    want = weight[:, picks.to(DEVICE)].t()
    assert torch.equal(logits[exact], want[exact])
    assert ((logits - want).abs() <= 2.0**-124).all()


def test_split_ranges_cover_k() -> None:
    for inner in (16, 130, 2048, 5000):
        splits, per_split = router_splits(inner)
        assert (splits - 1) * per_split < inner <= splits * per_split
        assert per_split % router_gemm_module._CONFIG[2] == 0
    assert router_splits(2048) == (16, 128)  # LLaDA2.1-mini: 16 N tiles x 16 splits


@settings(max_examples=6, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32]), seed=st.integers(0, 2**16),
       splits=st.sampled_from([2, 3, 8]))
def test_moe_route_sums_partials_first(tokens: int, splits: int, seed: int) -> None:
    """`[S, T, E]` partials route exactly as their left-to-right sum does, kernel and reference."""
    gen = torch.Generator().manual_seed(seed)
    partial = (torch.randn(splits, tokens, 256, generator=gen) * 2.0).to(DEVICE)
    expert_bias = (torch.randn(256, generator=gen) * 0.1).to(DEVICE)
    total = partial[0]
    for s in range(1, splits):
        total = total + partial[s]
    for route in (moe_route, moe_route_reference):
        ids, weights = route(partial, expert_bias, *LLADA21_MINI)
        want_ids, want_weights = route(total, expert_bias, *LLADA21_MINI)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_bad_inputs_name_the_tensor() -> None:
    x, weight = make_case(3, 16, 32, 0)
    with pytest.raises(ValueError, match=r"x must be bf16 \[T <= 64, K\]"):
        router_gemm(torch.zeros(65, 32, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match=r"weight must be fp32 \[N, K=32\]"):
        router_gemm(x, weight.bfloat16())
    with pytest.raises(ValueError, match=r"logits must be fp32 \[T, E\] or \[S, T, E\]"):
        moe_route(torch.zeros(1, 1, 2, 16), torch.zeros(16), 4, 2, 4, True, 1.0)


def test_opcheck() -> None:
    x, weight = make_case(3, 16, 32, 1)
    torch.library.opcheck(torch.ops.dlmc.router_gemm.default, (x, weight),
                          test_utils=("test_schema", "test_faketensor"))
    partial = torch.randn(3, 5, 16, device=DEVICE)
    torch.library.opcheck(torch.ops.dlmc.moe_route.default,
                          (partial, torch.zeros(16, device=DEVICE), 4, 2, 4, True, 2.5),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    """GEMM + routing of LLaDA2.1-mini's router, compiled and replayed in a CUDA graph."""
    x, weight = make_case(32, 256, 2048, 3)
    expert_bias = torch.randn(256, device=DEVICE) * 0.1

    def route(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        partial = router_gemm(t, weight)
        return (partial, *moe_route(partial, expert_bias, *LLADA21_MINI))

    graph, (partial, ids, weights) = compile_and_capture(route, x)
    for seed in range(3):
        x.copy_(make_case(32, 256, 2048, 10 + seed)[0])
        graph.replay()
        assert_logits(partial, x, weight)
        want = moe_route(router_gemm(x, weight), expert_bias, *LLADA21_MINI)
        assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])
