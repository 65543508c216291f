"""dlmc::router_logits against `x.float() @ weight.t()`.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
Products are exact in fp32, so only the summation order differs: the bound is a few fp32 ulps of
the sum of |products| (not of the possibly cancelling result).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.router_logits import router_logits, router_logits_reference
from dlmc.errors import ConfigError
from dlmc.models.moe import router_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(tokens: int, experts: int, hidden: int, log_scale: float,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 2.0**log_scale).bfloat16()
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).bfloat16().float()
    return x.to(DEVICE), weight.to(DEVICE)


def assert_matches(x: torch.Tensor, weight: torch.Tensor) -> None:
    got = router_logits(x, weight)
    want = router_logits_reference(x, weight)
    assert got.shape == want.shape and got.dtype == torch.float32
    magnitude = x.float().abs() @ weight.abs().t()  # [T, E], the sum of |products|
    assert ((got - want).abs() <= 2**-20 * magnitude + 1e-30).all()


@settings(max_examples=10, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 33]), experts=st.sampled_from([8, 16, 24, 256]),
       hidden=st.sampled_from([16, 200, 256]), log_scale=st.floats(-10, 10),
       seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, experts: int, hidden: int, log_scale: float,
                           seed: int) -> None:
    assert_matches(*make_case(tokens, experts, hidden, log_scale, seed))


def test_llada2_mini_router_shape() -> None:
    assert_matches(*make_case(32, 256, 2048, 0.0, 0))


def test_bad_inputs_name_the_tensor() -> None:
    x, weight = make_case(3, 8, 16, 0.0, 1)
    with pytest.raises(ValueError, match=r"x must be bf16 \[T, H\]"):
        router_logits(x.float(), weight)
    with pytest.raises(ValueError, match=r"weight must be fp32 \[E, H=16\]"):
        router_logits(x, weight[:, :8])


def test_opcheck() -> None:
    x, weight = make_case(3, 16, 32, 0.0, 2)
    torch.library.opcheck(torch.ops.dlmc.router_logits.default, (x, weight),
                          test_utils=("test_schema", "test_faketensor"))


def test_switch_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLMC_ROUTER_GEMM", raising=False)
    assert router_gemm() == "torch"
    monkeypatch.setenv("DLMC_ROUTER_GEMM", "triton")
    assert router_gemm() == "triton"
    monkeypatch.setenv("DLMC_ROUTER_GEMM", "cublas")
    with pytest.raises(ConfigError, match="DLMC_ROUTER_GEMM='cublas'"):
        router_gemm()


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    x, weight = make_case(32, 256, 2048, 0.0, 3)
    fn = torch.compile(lambda t: router_logits(t, weight), fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    for seed in range(3):
        x.copy_(make_case(32, 256, 2048, 0.0, 10 + seed)[0])
        graph.replay()
        want = router_logits_reference(x, weight)
        magnitude = x.float().abs() @ weight.abs().t()
        assert ((out - want).abs() <= 2**-20 * magnitude + 1e-30).all()
