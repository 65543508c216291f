"""Kernels v5-v7 of `dlmc::nvfp4_moe` (weights repacked at load into `nvfp4_words`' layout; v6
with v4's pre-decoded scales too, v7 with `nvfp4_scale_codes`' one-byte codes): bit for bit v3's
output.

On CPU the kernels run under `TRITON_INTERPRET=1` with the v2 decode, so the op hands them
ModelOpt bytes (the words unpacked per call, exact): these tests check the storage forms and
their conversions; the GPU tests compare the compiled asm paths, and the words' decode itself is
checked against v3's on the CPU in test_nvfp4_words.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_words import can_pack, stored_forms
from tests.custom_ops.test_nvfp4_moe import (
    DEVICE,
    assert_matches_reference,
    op_args,
    random_experts,
    random_routing,
)
from tests.custom_ops.test_nvfp4_moe_v4 import (
    ALL_CODES,
    ALL_FINITE,
    SCALES,
    bits,
    kernel_variant,
    predecoded,
    variant_equals_v3,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
WEIGHTS = ("gate_weight", "up_weight", "down_weight")


def stored(experts: dict[str, torch.Tensor], variant: int) -> dict[str, torch.Tensor]:
    """What `NVFP4Experts.prepare_for_kernel` stores for `variant` (5: tiled words and E4M3
    scales; 6: scales pre-decoded too; 7: one-byte scale codes), or v3/v4's forms where the
    shapes cannot be tiled."""
    inter, hidden = experts["gate_weight"].shape[1], experts["down_weight"].shape[1]
    if not (can_pack(inter, hidden) and can_pack(hidden, inter)):
        return predecoded(experts) if variant == 6 else dict(experts)
    out = dict(experts)
    for weight, scale in zip(WEIGHTS, SCALES, strict=True):
        out[weight], out[scale] = stored_forms(experts[weight], experts[scale], variant)
    return out


def v3_v5_case(variant: int, *case: object, **kwargs: object) -> None:
    """v5-v7 from their stored forms, and from ModelOpt's converted per call, == v3."""
    variant_equals_v3(variant, lambda experts: stored(experts, variant), *case, **kwargs)


FUZZ = given(  # 128 x 128 and 256 x 128 take the tiled layout, the others fall back to v3/v4
    seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17, 40]),
    num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
    hidden=st.sampled_from([128, 256, 48]), inter=st.sampled_from([128, 80]),
    skew=st.booleans(),
)


@pytest.mark.parametrize("variant", [5, 6, 7])
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@FUZZ
def test_v5_v6_equal_v3_cpu(variant: int, seed: int, tokens: int, num_experts: int, top_k: int,
                            hidden: int, inter: int, skew: bool) -> None:
    v3_v5_case(variant, seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
               ALL_CODES)


@pytest.mark.parametrize("variant", [5, 6, 7])
def test_v5_v6_tiled_equal_v3_cpu(variant: int) -> None:
    """A shape the tiled layout takes, every code, experts with no tokens: the tiled loads."""
    v3_v5_case(variant, 7, 17, 5, 2, 256, 128, True, ALL_CODES)


def test_words_run_under_every_variant_and_the_reference() -> None:
    """A module packed for v6/v7 runs under every variant and the reference (converted exactly)."""
    gen = torch.Generator().manual_seed(13)
    experts = random_experts(gen, 3, 128, 128)  # a shape the tiled layout takes
    x = torch.randn(4, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    ref = nvfp4_moe_reference(*op_args(x, ids, w, experts))
    for form, scale_dtype in ((6, torch.int16), (7, torch.int8)):
        packed = stored(experts, form)
        assert packed["gate_weight"].dtype == torch.int32
        assert packed["up_weight_scale"].dtype == scale_dtype
        assert torch.equal(bits(nvfp4_moe_reference(*op_args(x, ids, w, packed))), bits(ref))
        for variant in (1, 2, 3, 4, 5, 6, 7):
            with kernel_variant(variant):
                assert torch.equal(bits(nvfp4_moe(*op_args(x, ids, w, packed))),
                                   bits(nvfp4_moe(*op_args(x, ids, w, experts))))
    with kernel_variant(5):
        assert_matches_reference(nvfp4_moe(*op_args(x, ids, w, packed)), ref)


def test_words_of_the_wrong_shape_are_named() -> None:
    gen = torch.Generator().manual_seed(14)
    experts = random_experts(gen, 3, 128, 128)
    x = torch.randn(4, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    bad = stored(experts, 5)
    bad["up_weight"] = bad["up_weight"][..., :-1].contiguous()
    with pytest.raises(ValueError, match=r"up_weight must be torch.int32 \(3, 128, 16\)"):
        nvfp4_moe(*op_args(x, ids, w, bad))
    small = random_experts(gen, 3, 48, 16)  # K = 48: no tiled layout
    bad = dict(small, down_weight_scale=small["down_weight_scale"].view(torch.uint8))
    with pytest.raises(ValueError, match="down_weight_scale is in the tiled layout"):
        nvfp4_moe(*op_args(x[:, :48].contiguous(), ids, w, bad))


GPU_FUZZ = given(  # shapes the tiled layout takes (others run v3 itself: nothing to compare)
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 24),
    top_k=st.integers(1, 8), hidden=st.sampled_from([128, 256, 2048]),
    inter=st.sampled_from([128, 512]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [5, 6, 7])
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@GPU_FUZZ
def test_v5_v6_equal_v3_gpu(variant: int, seed: int, tokens: int, num_experts: int, top_k: int,
                            hidden: int, inter: int, skew: bool,
                            scale_2_log2: tuple[float, float]) -> None:
    """The compiled asm paths: bit for bit v3, every E4M3 and E2M1 code."""
    v3_v5_case(variant, seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
               ALL_CODES, scale_2_log2=scale_2_log2)
    # progress for `pytest -s` runs with a time limit (perf/README.md records the count)
    print(f"v{variant} == v3: tokens={tokens} experts={num_experts} top_k={top_k} "
          f"hidden={hidden} inter={inter} skew={skew} scale_2_log2={scale_2_log2}", flush=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [5, 6, 7])
def test_v5_v6_w4a4_and_negative_scales_gpu(variant: int) -> None:
    gen = torch.Generator().manual_seed(11)
    scales = {f"{p}_input_scale": (torch.rand(8, generator=gen) * 0.01 + 1e-3).to(DEVICE)
              for p in ("gate", "up", "down")}
    v3_v5_case(variant, 12, 5, 8, 2, 32, 48, False, ALL_FINITE, emulate_w4a4=True, **scales)


@pytest.mark.parametrize("variant", [5, 7])
def test_stored_forms_trace_fullgraph(variant: int) -> None:
    """The op on a module's stored forms (int32 words, tiled uint8 / int8 scales) traces without
    graph breaks, as compiled rounds need, and gives v3's output."""
    gen = torch.Generator().manual_seed(9)
    experts = random_experts(gen, 3, 128, 128)
    x = torch.randn(5, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 5, 3, 2, skew=False)
    with kernel_variant(3):
        v3 = nvfp4_moe(*op_args(x, ids, w, experts))
    args = op_args(x, ids, w, stored(experts, variant))
    torch._dynamo.reset()
    with kernel_variant(variant):
        compiled = torch.compile(nvfp4_moe, backend="aot_eager", fullgraph=True)
        assert torch.equal(bits(compiled(*args)), bits(v3))
