"""Kernel v4 of `dlmc::nvfp4_moe` (DLMC_NVFP4_KERNEL=v4: block scales pre-decoded at load to
bf16 `scale * 2^119`): bit for bit v3's output, and the reference's up to summation order.

On CPU the kernels run under `TRITON_INTERPRET=1`, where v3 and v4 both take the v2 decode (no
inline asm), v4 from its pre-decoded scales; the GPU tests compare the compiled asm paths. (v4's
single-code exactness and compile + CUDA-graph replay tests are v3's, parametrized, in
test_nvfp4_moe.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dlmc.custom_ops.nvfp4_moe as module
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_scales import predecode_block_scales
from tests.custom_ops.test_nvfp4_moe import (
    DEVICE,
    assert_matches_reference,
    op_args,
    random_experts,
    random_routing,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
SCALES = ("gate_weight_scale", "up_weight_scale", "down_weight_scale")


@contextlib.contextmanager
def kernel_variant(variant: int) -> Iterator[None]:
    """DLMC_NVFP4_KERNEL is read at import; patch the variant in for one block."""
    previous, module._VARIANT = module._VARIANT, variant
    try:
        yield
    finally:
        module._VARIANT = previous


def with_scale_codes(experts: dict[str, torch.Tensor], gen: torch.Generator,
                     codes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The experts with every block scale drawn from the E4M3 bit patterns `codes`."""
    out = dict(experts)
    for name in SCALES:
        pick = torch.randint(0, codes.numel(), experts[name].shape, generator=gen)
        out[name] = codes[pick].view(torch.float8_e4m3fn).to(DEVICE)
    return out


def predecoded(experts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `NVFP4Experts.prepare_for_kernel` stores for v4: bf16 block scales."""
    return experts | {name: predecode_block_scales(experts[name]) for name in SCALES}


ALL_FINITE = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # compares NaN and -0 bit for bit too


Experts = dict[str, torch.Tensor]


def variant_equals_v3(variant: int, store: Callable[[Experts], Experts],
                      seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                      inter: int, skew: bool, codes: torch.Tensor,
                      scale_2_log2: tuple[float, float] = (-4.0, 1.0), **kwargs: object) -> None:
    """Kernel `variant` on the experts in its stored form (`store`), and on ModelOpt's forms
    converted per call, == v3, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter, scale_2_log2=scale_2_log2)
    experts = with_scale_codes(experts, gen, codes)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    with kernel_variant(3):
        v3 = nvfp4_moe(*op_args(x, ids, w, experts), **kwargs)
    with kernel_variant(variant):
        stored = nvfp4_moe(*op_args(x, ids, w, store(experts)), **kwargs)
        per_call = nvfp4_moe(*op_args(x, ids, w, experts), **kwargs)
    assert torch.equal(bits(stored), bits(v3))
    assert torch.equal(bits(per_call), bits(v3))


def v3_v4_case(*case: object, **kwargs: object) -> None:
    """v4 (pre-decoded scales, and fp8 scales converted per call) == v3, bit for bit."""
    variant_equals_v3(4, predecoded, *case, **kwargs)


FUZZ = given(
    seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17, 64]),
    num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
    hidden=st.sampled_from([16, 48, 160]), inter=st.sampled_from([16, 48, 80]),
    skew=st.booleans(),
)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@FUZZ
def test_v4_equals_v3_cpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                          inter: int, skew: bool) -> None:
    """Every E4M3 code (±0, subnormals, negatives, 448 and the NaN codes, which v3 and v4 both
    read as ±480), every E2M1 code, K/N off the tile, experts with no tokens (skew)."""
    v3_v4_case(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
               ALL_CODES)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@FUZZ
def test_v4_matches_reference_cpu(seed: int, tokens: int, num_experts: int, top_k: int,
                                  hidden: int, inter: int, skew: bool) -> None:
    """Finite scales 2^-9..448 (the NaN codes excluded: the reference's float(scale) is NaN);
    the reference takes the pre-decoded scales too and converts them back exactly."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, min(top_k, num_experts), skew)
    ref = nvfp4_moe_reference(*op_args(x, ids, w, experts))
    args = op_args(x, ids, w, predecoded(experts))
    assert torch.equal(nvfp4_moe_reference(*args), ref)
    with kernel_variant(4):
        assert_matches_reference(nvfp4_moe(*args), ref)


def test_v4_zero_token_experts_w4a4_and_negative_scales() -> None:
    gen = torch.Generator().manual_seed(11)
    experts = random_experts(gen, 8, 32, 48)
    scales = {f"{p}_input_scale": (torch.rand(8, generator=gen) * 0.01 + 1e-3).to(DEVICE)
              for p in ("gate", "up", "down")}
    x = torch.randn(3, 32, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[5, 2], [2, 5], [5, 7]], dtype=torch.int32, device=DEVICE)
    w = torch.rand(3, 2, generator=gen).to(DEVICE)
    args = op_args(x, ids, w, predecoded(experts))
    with kernel_variant(4):
        assert_matches_reference(nvfp4_moe(*args), nvfp4_moe_reference(*args))
        w4a4 = nvfp4_moe(*args, emulate_w4a4=True, **scales)
    assert_matches_reference(w4a4, nvfp4_moe_reference(*args, emulate_w4a4=True, **scales))
    with kernel_variant(4):
        empty = op_args(x[:0], ids[:0], w[:0], predecoded(experts))
        assert nvfp4_moe(*empty).shape == (0, 32)
    v3_v4_case(12, 5, 8, 2, 32, 48, False, ALL_FINITE, emulate_w4a4=True,
               **scales)  # negative and -0 scales, W4A4 emulation


def test_v1_to_v3_accept_predecoded_scales() -> None:
    """A module converted for v4 still runs under v1-v3 (scales converted back exactly)."""
    gen = torch.Generator().manual_seed(13)
    experts = random_experts(gen, 3, 48, 16)
    x = torch.randn(4, 48, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    for variant in (1, 2, 3):
        with kernel_variant(variant):
            assert torch.equal(bits(nvfp4_moe(*op_args(x, ids, w, predecoded(experts)))),
                               bits(nvfp4_moe(*op_args(x, ids, w, experts))))


def test_v4_opcheck() -> None:
    gen = torch.Generator().manual_seed(14)
    experts = predecoded(random_experts(gen, 3, 32, 16))
    x = torch.randn(4, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    args = [t.view(torch.int16) if t.dtype == torch.bfloat16 and t.dim() == 3 else t
            for t in op_args(x, ids, w, experts)]  # the op takes the bf16 scales' bit patterns
    with kernel_variant(4):
        torch.library.opcheck(torch.ops.dlmc.nvfp4_moe.default, args)


GPU_FUZZ = given(
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
    top_k=st.integers(1, 8), hidden=st.sampled_from([16, 48, 128, 272, 2048]),
    inter=st.sampled_from([16, 80, 512]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@GPU_FUZZ
def test_v4_equals_v3_gpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                          inter: int, skew: bool, scale_2_log2: tuple[float, float]) -> None:
    """The compiled asm paths: v4 bit for bit v3, every E4M3 code (NaN codes too)."""
    v3_v4_case(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
               ALL_CODES, scale_2_log2=scale_2_log2)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@GPU_FUZZ
def test_v4_matches_reference_gpu(seed: int, tokens: int, num_experts: int, top_k: int,
                                  hidden: int, inter: int, skew: bool,
                                  scale_2_log2: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter, scale_2_log2=scale_2_log2)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, min(top_k, num_experts), skew)
    args = op_args(x, ids, w, predecoded(experts))
    with kernel_variant(4):
        assert_matches_reference(nvfp4_moe(*args), nvfp4_moe_reference(*args))
