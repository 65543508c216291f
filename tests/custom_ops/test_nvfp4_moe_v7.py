"""Kernel v7 of `dlmc::nvfp4_moe` (weights repacked at load into `nvfp4_words`' tiled words, block
scales into `nvfp4_scale_codes`' one-byte codes): bit for bit kernel v3's output, and the
reference's up to summation order.

On CPU the kernels run under `TRITON_INTERPRET=1` with the plain Triton decode, so the op hands
v7 ModelOpt's bits tiled (the words unpacked per call, exact): these tests check the stored forms,
their conversions and the tiled loads; the GPU tests compare the compiled asm paths, and the
words' decode itself is checked against v3's on the CPU in test_nvfp4_words.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    bits,
    kernel_v3,
    op_args,
    random_experts,
    random_routing,
    stored,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
SCALES = ("gate_weight_scale", "up_weight_scale", "down_weight_scale")
ALL_FINITE = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def with_scale_codes(experts: dict[str, torch.Tensor], gen: torch.Generator,
                     codes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The experts with every block scale drawn from the E4M3 bit patterns `codes`."""
    out = dict(experts)
    for name in SCALES:
        pick = torch.randint(0, codes.numel(), experts[name].shape, generator=gen)
        out[name] = codes[pick].view(torch.float8_e4m3fn).to(DEVICE)
    return out


def v7_equals_v3(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                 skew: bool, codes: torch.Tensor, scale_2_log2: tuple[float, float] = (-4.0, 1.0),
                 **kwargs: object) -> None:
    """The op on the experts in v7's stored forms, and on ModelOpt's forms converted per call,
    == kernel v3, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter, scale_2_log2=scale_2_log2)
    experts = with_scale_codes(experts, gen, codes)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    with kernel_v3():
        v3 = nvfp4_moe(*op_args(x, ids, w, experts), **kwargs)
    packed = nvfp4_moe(*op_args(x, ids, w, stored(experts)), **kwargs)
    per_call = nvfp4_moe(*op_args(x, ids, w, experts), **kwargs)
    assert torch.equal(bits(packed), bits(v3))
    assert torch.equal(bits(per_call), bits(v3))


FUZZ = given(  # 128 x 128 and 256 x 128 take the tiled layout, the others fall back to v3
    seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17, 40]),
    num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
    hidden=st.sampled_from([128, 256, 48]), inter=st.sampled_from([128, 80]),
    skew=st.booleans(),
)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@FUZZ
@example(seed=15919, tokens=3, num_experts=2, top_k=1, hidden=256, inter=128, skew=False)
def test_v7_equals_v3_cpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                          inter: int, skew: bool) -> None:
    """Every E4M3 code (±0, subnormals, negatives, 448 and the NaN codes, which v3 and v7 both
    read as ±480), every E2M1 code, experts with no tokens (skew)."""
    v7_equals_v3(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
                 ALL_CODES)


def test_v7_tiled_equals_v3_cpu() -> None:
    """A shape the tiled layout takes, every code, experts with no tokens: the tiled loads."""
    v7_equals_v3(7, 17, 5, 2, 256, 128, True, ALL_CODES)


def test_v7_zero_token_experts_w4a4_and_negative_scales() -> None:
    gen = torch.Generator().manual_seed(11)
    scales = {f"{p}_input_scale": (torch.rand(8, generator=gen) * 0.01 + 1e-3).to(DEVICE)
              for p in ("gate", "up", "down")}
    v7_equals_v3(12, 5, 8, 2, 128, 128, False, ALL_FINITE, emulate_w4a4=True, **scales)
    experts = stored(random_experts(gen, 8, 128, 128))
    x = torch.randn(3, 128, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[5, 2], [2, 5], [5, 7]], dtype=torch.int32, device=DEVICE)
    empty = op_args(x[:0], ids[:0], torch.zeros(0, 2, device=DEVICE), experts)
    assert nvfp4_moe(*empty).shape == (0, 128)


def test_v3_baseline_takes_v7s_tiles() -> None:
    """62 tokens x top-7 of 21 experts (about 21 pairs per expert): v3's own choice is one
    64-slot block per expert and 64-wide gate/up N-tiles, v7's 32 slots and 128; the baseline
    runs v3 with v7's."""
    ids = torch.zeros(62, 7, dtype=torch.int32)
    x = torch.zeros(62, 128, dtype=torch.bfloat16)
    v7 = launch._plan(x, ids, 21, 128, False, False, True)
    v3_own = launch._plan(x, ids, 21, 704, False, False, True)
    with kernel_v3():
        baseline = launch._plan(x, ids, 21, 128, False, False, True)
    assert (v7.variant, v7.tiles.block_m, v7.tiles.gate_up_block_n) == (7, 32, 128)
    assert (v3_own.variant, v3_own.tiles.block_m, v3_own.tiles.gate_up_block_n) == (3, 64, 64)
    assert baseline.variant == 3 and baseline.tiles == v7.tiles


def test_words_run_under_both_kernels_and_the_reference() -> None:
    """A module packed for v7 runs under v3 and the reference too (converted exactly)."""
    gen = torch.Generator().manual_seed(13)
    experts = random_experts(gen, 3, 128, 128)  # a shape the tiled layout takes
    x = torch.randn(4, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    ref = nvfp4_moe_reference(*op_args(x, ids, w, experts))
    packed = stored(experts)
    assert packed["gate_weight"].dtype == torch.int32
    assert packed["up_weight_scale"].dtype == torch.int8
    assert torch.equal(bits(nvfp4_moe_reference(*op_args(x, ids, w, packed))), bits(ref))
    with kernel_v3():
        assert torch.equal(bits(nvfp4_moe(*op_args(x, ids, w, packed))),
                           bits(nvfp4_moe(*op_args(x, ids, w, experts))))
    assert_matches_reference(nvfp4_moe(*op_args(x, ids, w, packed)), ref)


def test_words_of_the_wrong_shape_are_named() -> None:
    gen = torch.Generator().manual_seed(14)
    experts = random_experts(gen, 3, 128, 128)
    x = torch.randn(4, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    bad = stored(experts)
    bad["up_weight"] = bad["up_weight"][..., :-1].contiguous()
    with pytest.raises(ValueError, match=r"up_weight must be torch.int32 \(3, 128, 16\)"):
        nvfp4_moe(*op_args(x, ids, w, bad))
    small = random_experts(gen, 3, 48, 16)  # K = 48: no tiled layout
    bad = dict(small, down_weight_scale=torch.zeros(3, 48, 1, dtype=torch.int8, device=DEVICE))
    with pytest.raises(ValueError, match="down_weight_scale is in the tiled layout"):
        nvfp4_moe(*op_args(x[:, :48].contiguous(), ids, w, bad))


def test_stored_forms_trace_fullgraph() -> None:
    """The op on a module's stored forms (int32 words, tiled int8 codes) traces without graph
    breaks, as compiled rounds need, and gives v3's output."""
    gen = torch.Generator().manual_seed(9)
    experts = random_experts(gen, 3, 128, 128)
    x = torch.randn(5, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 5, 3, 2, skew=False)
    with kernel_v3():
        v3 = nvfp4_moe(*op_args(x, ids, w, experts))
    args = op_args(x, ids, w, stored(experts))
    torch._dynamo.reset()
    compiled = torch.compile(nvfp4_moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(bits(compiled(*args)), bits(v3))


GPU_FUZZ = given(  # shapes the tiled layout takes (others run v3 itself: nothing to compare)
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 24),
    top_k=st.integers(1, 8), hidden=st.sampled_from([128, 256, 2048]),
    inter=st.sampled_from([128, 512]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@GPU_FUZZ
@example(seed=0, tokens=62, num_experts=21, top_k=7, hidden=128, inter=128, skew=False,
         scale_2_log2=(-4.0, 1.0))  # in v3's own tiles: a bf16 ulp off v7's
def test_v7_equals_v3_gpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                          inter: int, skew: bool, scale_2_log2: tuple[float, float]) -> None:
    """The compiled asm paths: bit for bit v3, every E4M3 and E2M1 code."""
    v7_equals_v3(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
                 ALL_CODES, scale_2_log2=scale_2_log2)


@pytest.mark.gpu
def test_v7_w4a4_and_negative_scales_gpu() -> None:
    gen = torch.Generator().manual_seed(11)
    scales = {f"{p}_input_scale": (torch.rand(8, generator=gen) * 0.01 + 1e-3).to(DEVICE)
              for p in ("gate", "up", "down")}
    v7_equals_v3(12, 5, 8, 2, 128, 128, False, ALL_FINITE, emulate_w4a4=True, **scales)
