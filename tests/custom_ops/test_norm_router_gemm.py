"""dlmc::norm_router_gemm (the post-attention RMSNorm applied on the way into the router's
split-K GEMM) against `rms_norm` and `router_gemm`'s maths.

The norm's mean comes from `dlmc::linear_residual`'s tile sums instead of one row reduction:
the fp32 sum differs in order only, so a normalised element can land a bf16 step or two away
from `rms_norm`'s where a product sits on a rounding boundary; the router partials are those of
the normalised rows the op returns.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.linear_residual import tile_sums_of_squares
from dlmc.custom_ops.norm_router_gemm import norm_router_gemm, norm_router_gemm_reference
from dlmc.custom_ops.qk_norm_rope import rms_norm
from dlmc.custom_ops.router_gemm import router_gemm

from .graph_capture import compile_and_capture
from .test_router_gemm import assert_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def make_case(tokens: int, hidden: int, experts: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=gen) * 3).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    weight = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
    return (h.to(DEVICE), tile_sums_of_squares(h).to(DEVICE), norm_weight.to(DEVICE),
            weight.to(DEVICE))


def assert_normed(xn: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """`rms_norm(h)`, nearly all elements equal; the others within two bf16 steps (one step of
    `bf16(h * rstd)`, scaled by the weight, then the product's own rounding)."""
    want = rms_norm(h, norm_weight, EPS)
    assert xn.dtype == torch.bfloat16 and xn.shape == h.shape
    step = want.float().abs().clamp_min(1e-30) * 2**-6
    assert ((xn.float() - want.float()).abs() <= step).all()
    assert (xn != want).float().mean() <= 0.01


@settings(max_examples=10, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 64]), hidden=st.sampled_from([64, 96, 512, 4160]),
       experts=st.sampled_from([16, 40, 256]), seed=st.integers(0, 2**16))
def test_normed_rows_and_router_partials(tokens: int, hidden: int, experts: int,
                                         seed: int) -> None:
    h, sumsq, norm_weight, weight = make_case(tokens, hidden, experts, seed)
    xn, partial = norm_router_gemm(h, sumsq, norm_weight, EPS, weight)
    assert_normed(xn, h, norm_weight)
    assert_logits(partial, xn, weight)
    assert torch.equal(partial, router_gemm(xn, weight))  # the same tiles, splits and dots


def test_several_k_tiles_per_split() -> None:
    """4160 wide: 11 splits of three 128-column tiles each, the last one partly past H."""
    h, sumsq, norm_weight, weight = make_case(5, 4160, 40, 2)
    xn, partial = norm_router_gemm(h, sumsq, norm_weight, EPS, weight)
    assert_normed(xn, h, norm_weight)
    assert torch.equal(partial, router_gemm(xn, weight))


def test_reference_is_the_same_maths() -> None:
    h, sumsq, norm_weight, weight = make_case(32, 2048, 256, 4)
    xn, partial = norm_router_gemm_reference(h, sumsq, norm_weight, EPS, weight)
    assert_normed(xn, h, norm_weight)
    assert_logits(partial, xn, weight)


def test_bad_operands_are_named() -> None:
    h, sumsq, norm_weight, weight = make_case(3, 64, 16, 0)
    with pytest.raises(ValueError, match=r"norm_router_gemm: sumsq must be fp32 \[2, T=3\]"):
        norm_router_gemm(h, sumsq[:1], norm_weight, EPS, weight)
    with pytest.raises(ValueError, match=r"norm_router_gemm: norm_weight must be bf16 \[64\]"):
        norm_router_gemm(h, sumsq, norm_weight.float(), EPS, weight)
    with pytest.raises(ValueError, match="norm_router_gemm: weight must be fp32"):
        norm_router_gemm(h, sumsq, norm_weight, EPS, weight.bfloat16())


def test_opcheck() -> None:
    h, sumsq, norm_weight, weight = make_case(3, 64, 16, 1)
    torch.library.opcheck(torch.ops.dlmc.norm_router_gemm.default,
                          (h, sumsq, norm_weight, EPS, weight, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    """LLaDA2.1-mini's post-attention norm and router (2048 wide, 256 experts), compiled and
    replayed in a CUDA graph on new rows."""
    h, sumsq, norm_weight, weight = make_case(32, 2048, 256, 3)
    graph, (xn, partial) = compile_and_capture(
        lambda a, s: norm_router_gemm(a, s, norm_weight, EPS, weight), h, sumsq)
    for seed in range(3):
        new_h, new_sumsq, _, _ = make_case(32, 2048, 256, 10 + seed)
        h.copy_(new_h)
        sumsq.copy_(new_sumsq)
        graph.replay()
        assert_normed(xn, h, norm_weight)
        assert torch.equal(partial, router_gemm(xn, weight))
