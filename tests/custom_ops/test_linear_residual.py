"""dlmc::linear_residual (`residual + x @ W^T` split-K, the sum taken by each column tile's last
program, and the tiles' sums of squares) against `dlmc::split_k_linear` and the torch maths.

The kernel's partials are `split_k_linear`'s (same tiles, same K splits), summed in the same
order and rounded once, so `h` equals `residual + split_k_linear(x, W).sum(0).to(bf16)` bit for
bit; on CPU under Triton's interpreter (tests/conftest.py) the programs run one after another,
on the GPU in any order, which the ticket makes irrelevant.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlmc.custom_ops.linear_residual as linear_residual_module
from dlmc.custom_ops.linear_residual import (
    BLOCK_N,
    linear_residual,
    linear_residual_reference,
    tile_sums_of_squares,
)
from dlmc.custom_ops.split_k_linear import split_k_linear

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(tokens: int, features: int, inner: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inner, generator=gen).bfloat16()
    weight = (torch.randn(features, inner, generator=gen) * inner**-0.5).bfloat16()
    residual = (torch.randn(tokens, features, generator=gen) * 4).bfloat16()
    return x.to(DEVICE), weight.to(DEVICE), residual.to(DEVICE)


def assert_result(h: torch.Tensor, sumsq: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  residual: torch.Tensor) -> None:
    """h is the split-K product summed and rounded, plus the residual, bit for bit; sumsq each
    tile's sum of h^2 per row to fp32 rounding; the ticket counters are zero again."""
    want = residual + split_k_linear(x, weight).sum(0).to(torch.bfloat16)
    assert h.dtype == torch.bfloat16 and torch.equal(h, want)
    tiles = -(-weight.shape[0] // BLOCK_N)
    assert sumsq.shape == (tiles, x.shape[0]) and sumsq.dtype == torch.float32
    torch.testing.assert_close(sumsq, tile_sums_of_squares(want), rtol=2e-6, atol=1e-30)
    assert not linear_residual_module._TICKETS[h.device].any()


@settings(max_examples=10, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 64]), features=st.sampled_from([16, 40, 96]),
       inner=st.sampled_from([16, 130, 512, 1040]), seed=st.integers(0, 2**16))
def test_residual_plus_the_split_k_product(tokens: int, features: int, inner: int,
                                           seed: int) -> None:
    x, weight, residual = make_case(tokens, features, inner, seed)
    h, sumsq = linear_residual(x, weight, residual)
    assert_result(h, sumsq, x, weight, residual)
    again = linear_residual(x, weight, residual)  # the counters were left at zero
    assert torch.equal(again[0], h) and torch.equal(again[1], sumsq)


def test_reference_is_the_same_maths() -> None:
    """The torch maths (CPU without the interpreter) within bf16 rounding of the kernel, and
    exactly its own tile sums."""
    x, weight, residual = make_case(32, 64, 2048, 7)
    h, sumsq = linear_residual(x, weight, residual)
    ref_h, ref_sumsq = linear_residual_reference(x, weight, residual)
    step = ref_h.float().abs().clamp_min(1e-30) * 2**-7
    assert ((h.float() - ref_h.float()).abs() <= step).all()
    assert torch.equal(ref_sumsq, tile_sums_of_squares(ref_h))
    torch.testing.assert_close(sumsq, ref_sumsq, rtol=2e-2, atol=1e-3)


def test_strided_inputs_and_an_empty_block() -> None:
    x, weight, residual = make_case(5, 40, 300, 1)
    wide = torch.zeros(5, 48, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :40] = residual
    h, sumsq = linear_residual(x.t().contiguous().t(), weight, wide[:, :40])
    assert_result(h, sumsq, x, weight, residual)
    h, sumsq = linear_residual(x[:0], weight, residual[:0])
    assert h.shape == (0, 40) and sumsq.shape == (2, 0)


def test_bad_operands_are_named() -> None:
    x, weight, residual = make_case(3, 16, 32, 0)
    with pytest.raises(ValueError, match=r"linear_residual: residual must be bf16 \[T=3, N=16\]"):
        linear_residual(x, weight, residual.float())
    with pytest.raises(ValueError, match=r"linear_residual: residual must be bf16 \[T=3, N=16\]"):
        linear_residual(x, weight, residual[:2])
    with pytest.raises(ValueError, match="linear_residual: weight must be bf16"):
        linear_residual(x, weight.float(), residual)


def test_opcheck() -> None:
    x, weight, residual = make_case(3, 40, 64, 1)
    torch.library.opcheck(torch.ops.dlmc.linear_residual.default, (x, weight, residual, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    """LLaDA2.1-mini's o_proj with the residual, compiled (an opaque op with PDL) and replayed
    in a CUDA graph on new inputs: still bit for bit the split-K sum."""
    x, weight, residual = make_case(32, 2048, 2048, 3)
    graph, (h, sumsq) = compile_and_capture(lambda a, r: linear_residual(a, weight, r),
                                            x, residual)
    for seed in range(3):
        new_x, _, new_residual = make_case(32, 2048, 2048, 10 + seed)
        x.copy_(new_x)
        residual.copy_(new_residual)
        graph.replay()
        assert_result(h, sumsq, x, weight, residual)
