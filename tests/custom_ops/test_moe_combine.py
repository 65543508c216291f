"""dlmc::moe_combine (the weighted sum of each token's expert outputs) against the fp32 sum.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
The kernel sums in fp32 in pair order (on the GPU possibly with FMA contraction) and the reference
may sum in another order, so results agree with the reference's fp32 sum `s` within one bf16
rounding step plus fp32 reassociation: `|out - s| <= 2^-8 |s| + 2^-24 sum_k |w_k y_k|`. With
integer-valued y and power-of-two weights every sum is exact, and the results are bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.moe_align import append_shared_column
from dlmc.custom_ops.moe_combine import combine_pointwise, moe_combine, moe_combine_reference

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(tokens: int, top_k: int, hidden: int, shared: bool, seed: int,
              spread: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 `y [T*P, H]` and fp32 `w [T, K]`: normal values scaled by 2^-spread .. 2^spread
    (y) and 2^-spread/2 .. 2^spread/2 (w), with ±0 in y and 0 in w mixed in."""
    gen = torch.Generator().manual_seed(seed)
    rows = tokens * (top_k + int(shared))
    scale = torch.exp2(torch.randint(-spread, spread + 1, (rows, hidden), generator=gen).float())
    y = torch.randn(rows, hidden, generator=gen) * scale
    zero = torch.rand(rows, hidden, generator=gen) < 0.05
    y = torch.where(zero, torch.where(torch.rand(rows, hidden, generator=gen) < 0.5, 0.0, -0.0),
                    y)
    half = spread // 2
    w = torch.randn(tokens, top_k, generator=gen) * torch.exp2(
        torch.randint(-half, half + 1, (tokens, top_k), generator=gen).float())
    w = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.1, 0.0, w)
    return y.bfloat16().to(DEVICE), w.to(DEVICE)


def assert_combined(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor, shared: bool) -> None:
    """`out` is within one bf16 rounding plus fp32 reassociation of the reference's fp32 sum."""
    weights = append_shared_column(w, 1.0) if shared else w  # [T, P]
    tokens, pairs = weights.shape
    products = y.view(tokens, pairs, -1).float() * weights[..., None]  # [T, P, H]
    exact = products.sum(dim=1)  # [T, H] the reference's fp32 sum
    bound = 2.0**-8 * exact.abs() + 2.0**-24 * products.abs().sum(dim=1)
    assert out.shape == exact.shape and out.dtype == torch.bfloat16
    excess = (out.float() - exact).abs() - bound
    assert (excess <= 0).all(), f"max excess {excess.max().item()} at {excess.argmax().item()}"
    assert torch.equal(moe_combine_reference(y, w, shared), exact.bfloat16())


@settings(max_examples=40 if DEVICE == "cpu" else 200, deadline=None)
@given(
    tokens=st.one_of(st.sampled_from([1, 3, 17]), st.integers(1, 40)),
    top_k=st.integers(1, 9), hidden=st.sampled_from([16, 48, 128, 1000, 2048]),
    shared=st.booleans(), spread=st.sampled_from([0, 8, 30]), seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference(tokens: int, top_k: int, hidden: int, shared: bool,
                                spread: int, seed: int) -> None:
    y, w = make_case(tokens, top_k, hidden, shared, seed, spread)
    assert_combined(moe_combine(y, w, shared), y, w, shared)
    assert_combined(combine_pointwise(y, w, shared), y, w, shared)  # compiled rounds' form


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("hidden", [48, 1000, 2048])
def test_exact_sums_are_bit_exact(hidden: int, shared: bool) -> None:
    """Integer-valued bf16 y and power-of-two weights (signed, or 0): every product and sum is
    exact in fp32, so only the final rounding to bf16 remains, and it must match."""
    gen = torch.Generator().manual_seed(hidden)
    tokens, top_k = 17, 8
    rows = tokens * (top_k + int(shared))
    y = torch.randint(-256, 257, (rows, hidden), generator=gen) * torch.exp2(
        torch.randint(0, 5, (rows, hidden), generator=gen).float())  # bf16 integers
    w = torch.exp2(torch.randint(-4, 5, (tokens, top_k), generator=gen).float())
    w = w * torch.randint(-1, 2, (tokens, top_k), generator=gen)  # signed, or 0
    y, w = y.bfloat16().to(DEVICE), w.to(DEVICE)
    out = moe_combine(y, w, shared)
    assert torch.equal(out.view(torch.int16), moe_combine_reference(y, w, shared).view(torch.int16))
    assert torch.equal(combine_pointwise(y, w, shared).view(torch.int16), out.view(torch.int16))


def test_no_tokens() -> None:
    out = moe_combine(torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE),
                      torch.empty(0, 4, device=DEVICE), shared_expert=True)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_errors_name_the_tensor() -> None:
    y, w = make_case(3, 2, 16, False, seed=0)
    with pytest.raises(ValueError, match="moe_combine: y must be bf16"):
        moe_combine(y.float(), w)
    with pytest.raises(ValueError, match=r"y must be bf16 \[T\*P=9, H\]"):
        moe_combine(y, w, shared_expert=True)  # 6 rows, 9 expected
    with pytest.raises(ValueError, match="moe_combine: topk_weights must be fp32"):
        moe_combine(y, w.bfloat16())
    with pytest.raises(ValueError, match="moe_combine: y must be contiguous"):
        moe_combine(torch.cat([y, y], dim=1)[:, ::2], w)


@pytest.mark.parametrize("shared", [False, True])
def test_opcheck(shared: bool) -> None:
    y, w = make_case(3, 4, 48, shared, seed=1)
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if DEVICE == "cuda":  # the interpreter cannot be traced
        utils.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.dlmc.moe_combine.default, (y, w, shared),
                          test_utils=tuple(utils))


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_compile_and_cuda_graph_replay(shared: bool) -> None:
    """LLaDA2.1-mini's combine (T=32, K=8, H=2048), compiled and replayed on changed inputs."""
    y, w = make_case(32, 8, 2048, shared, seed=2, spread=8)
    graph, out = compile_and_capture(lambda a, b: moe_combine(a, b, shared), y, w)
    for seed in range(3):
        new_y, new_w = make_case(32, 8, 2048, shared, seed=10 + seed, spread=8)
        y.copy_(new_y)
        w.copy_(new_w)
        graph.replay()
        assert_combined(out, y, w, shared)
