"""dlmc::small_m_linear against `F.linear` (BF16 in and out, fp32 accumulation).

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
where its dots are widened to fp32. Only the summation order differs from the reference, so
outputs agree to one bf16 step of the sum of |products|.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.small_m_linear import small_m_linear, small_m_linear_reference
from dlmc.errors import ConfigError
from dlmc.models.layers import SwiGLUMLP, linear, small_m_gemm

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(tokens: int, features: int, inner: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inner, generator=gen).bfloat16()
    weight = (torch.randn(features, inner, generator=gen) * inner**-0.5).bfloat16()
    return x.to(DEVICE), weight.to(DEVICE)


def assert_matches(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within one rounding of the result (bf16) plus a few fp32 ulps of the sum of |products|:
    products are exact, only the order of the fp32 sums differs from the reference."""
    want = x.float() @ weight.float().t()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    magnitude = x.float().abs() @ weight.float().abs().t()
    assert ((got.float() - want).abs() <= 2**-8 * want.abs() + 2**-20 * magnitude).all()
    torch.testing.assert_close(got, small_m_linear_reference(x, weight), rtol=2**-7, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 64]), features=st.sampled_from([16, 40, 96, 256]),
       inner=st.sampled_from([16, 130, 256]), seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, features: int, inner: int, seed: int) -> None:
    x, weight = make_case(tokens, features, inner, seed)
    assert_matches(small_m_linear(x, weight), x, weight)


def test_bad_inputs_name_the_tensor() -> None:
    x, weight = make_case(3, 16, 32, 0)
    with pytest.raises(ValueError, match=r"x must be bf16 \[T <= 64, K\]"):
        small_m_linear(torch.zeros(65, 32, dtype=torch.bfloat16), weight)
    for bad in (weight.half(), weight.float()):
        with pytest.raises(ValueError, match=r"weight must be bf16 \[N, K=32\]"):
            small_m_linear(x, bad)


def test_opcheck() -> None:
    x, weight = make_case(3, 16, 32, 1)
    torch.library.opcheck(torch.ops.dlmc.small_m_linear.default, (x, weight),
                          test_utils=("test_schema", "test_faketensor"))


def test_switch_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLMC_SMALL_M_GEMM", raising=False)
    monkeypatch.delenv("DLMC_ROUTER_GEMM", raising=False)
    assert small_m_gemm() == "splitk"
    monkeypatch.setenv("DLMC_SMALL_M_GEMM", "auto")  # the projections have no auto (the router)
    with pytest.raises(ConfigError, match="DLMC_SMALL_M_GEMM='auto'"):
        SwiGLUMLP(16, 8)
    monkeypatch.setenv("DLMC_SMALL_M_GEMM", "magic")
    with pytest.raises(ConfigError, match="DLMC_SMALL_M_GEMM='magic'"):
        SwiGLUMLP(16, 8)  # read at construction
    x, weight = make_case(3, 16, 32, 2)
    # CPU tensors always take F.linear; the op is for CUDA (or called directly, as above)
    torch.testing.assert_close(linear(x.cpu(), weight.cpu(), "triton"),
                               torch.nn.functional.linear(x.cpu(), weight.cpu()))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    x, weight = make_case(32, 3072, 2048, 3)
    graph, out = compile_and_capture(lambda t: small_m_linear(t, weight), x)
    for seed in range(3):
        x.copy_(make_case(32, 3072, 2048, 10 + seed)[0])
        graph.replay()
        assert_matches(out, x, weight)
