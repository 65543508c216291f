"""`dlmc::nvfp4_moe` with DiffusionGemma's experts: GELU (tanh approximation) instead of SiLU,
H = 2816, I = 704, 128 experts, top-8, a 256-token canvas; as the model runs them, widened with
zeros to I = 768 at load (kernel v7, `widen_experts`), and in the checkpoint's width (kernel v3).

On CPU the Triton kernels run under `TRITON_INTERPRET=1` on shapes with I = 704 and a narrow H;
the gpu-marked fuzz covers DiffusionGemma's full shapes with gelu_tanh, widened (200 examples)
and not (25) (perf/gpu.sh tests-fuzz-gelu).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_moe_tiles import ACTIVATIONS
from dlmc.models.nvfp4_experts import widen_experts
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    gluon_on_cpu,
    op_args,
    random_experts,
    random_routing,
    run_case,
    shared_expert,
    stored,
)

# The interpreter evaluates with numpy, which warns where exp(-g) or GELU's g^3 overflow (the
# results, 0 and +-inf, are the fp32 ones).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")]

# (H, I, E, K): DiffusionGemma's experts (the GPU fuzz; on CPU I = 704 with a narrow H).
DIFFUSIONGEMMA = (2816, 704, 128, 8)


def gelu_tanh_fp64(g: float) -> float:
    """PyTorch's `gelu(approximate="tanh")` formula in fp64."""
    return 0.5 * g * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def single_code_experts(hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Two experts whose every row has one code 1.0 at element 1, block scales 1.0, global
    scales 1.0: gate(x) = up(x) = x[1] in every column, down(h) = h[1] in every column."""
    experts = random_experts(torch.Generator().manual_seed(0), 2, hidden, inter)
    for proj in ("gate", "up", "down"):
        experts[f"{proj}_weight"].zero_()
        experts[f"{proj}_weight"][..., 0] = 0x20  # element 0: code 0 (0.0), element 1: 2 (1.0)
        experts[f"{proj}_weight_scale"].view(torch.uint8).fill_(0x38)  # E4M3 1.0
        experts[f"{proj}_weight_scale_2"].fill_(1.0)
    return experts


@pytest.mark.parametrize("inter", [16, 704])
def test_gelu_tanh_known_values(inter: int) -> None:
    """out[t] = bf16(gelu_tanh(g) * g) with g = x[t, 1] exactly: the op (interpreted) and the
    reference equal the fp64 formula rounded to bf16, which PyTorch's fp32 GELU also gives;
    SiLU gives other values."""
    g_values = [1.0, -1.0, 2.0, 0.5, -3.0, 0.0, 1.5, -0.5]
    x = torch.zeros(len(g_values), 32)
    x[:, 1] = torch.tensor(g_values)
    x = x.bfloat16().to(DEVICE)
    ids = torch.tensor([[t % 2] for t in range(len(g_values))], device=DEVICE)
    w = torch.ones(len(g_values), 1, device=DEVICE)
    args = op_args(x, ids, w, single_code_experts(32, inter))
    expected = torch.tensor([gelu_tanh_fp64(g) * g for g in g_values], dtype=torch.float64)
    expected = expected.bfloat16()[:, None].expand(-1, 32).to(DEVICE)
    torch_fp32 = torch.nn.functional.gelu(torch.tensor(g_values), approximate="tanh")
    assert torch.equal((torch_fp32 * torch.tensor(g_values)).bfloat16(), expected[:, 0].cpu())
    for out in (nvfp4_moe(*args, activation="gelu_tanh"),
                nvfp4_moe_reference(*args, activation="gelu_tanh")):
        assert torch.equal(out, expected), (out[:, 0], expected[:, 0])
    silu = nvfp4_moe(*args)
    assert not torch.equal(silu, expected)
    torch.testing.assert_close(silu, nvfp4_moe_reference(*args), rtol=0, atol=0)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17, 40]),
    num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
    hidden=st.sampled_from([16, 32, 48]), inter=st.sampled_from([16, 48, 80, 704]),
    skew=st.booleans(), scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)
def test_gelu_matches_reference_cpu(seed: int, tokens: int, num_experts: int, top_k: int,
                                    hidden: int, inter: int, skew: bool,
                                    scale_2_log2: tuple[float, float]) -> None:
    """Awkward shapes (I = 704, 80: not multiples of 128 or 64) and extreme global scales."""
    run_case(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
             scale_2_log2, activation="gelu_tanh")


@functools.lru_cache(maxsize=6)
def _fuzz_experts(shape: tuple[int, int, int, int], seed: int,
                  scale_2_log2: tuple[float, float] = (-4.0, 1.0)) -> dict[str, torch.Tensor]:
    """Random experts per (shape, seed % 2, global-scale range): DiffusionGemma's 128 experts
    are 380 MB."""
    hidden, inter, num_experts, _ = shape
    return random_experts(torch.Generator().manual_seed(seed), num_experts, hidden, inter,
                          scale_2_log2=scale_2_log2)


def widened(experts: dict[str, torch.Tensor], padded: int) -> dict[str, torch.Tensor]:
    """The experts widened with zero codes and scales to width `padded`, as
    `NVFP4Experts.pad_to_layout` widens them at load."""
    inter = experts["gate_weight"].shape[1]
    names = {f"{proj}_proj_{suffix}": f"{proj}_{suffix}" for proj in ("gate", "up", "down")
             for suffix in ("weight", "weight_scale")}
    wide = widen_experts({key: experts[name] for key, name in names.items()}, inter, padded)
    return {**experts, **{name: wide[key] for key, name in names.items()}}


@functools.lru_cache(maxsize=6)
def _stored_fuzz_experts(shape: tuple[int, int, int, int], seed: int,
                         scale_2_log2: tuple[float, float],
                         width: int | None) -> dict[str, torch.Tensor]:
    """`_fuzz_experts` as the model stores them, widened to `width` when given."""
    experts = _fuzz_experts(shape, seed, scale_2_log2)
    return stored(widened(experts, width) if width else experts)


def _fuzz_case(seed: int, tokens: int, shape: tuple[int, int, int, int], activation: str,
               skew: bool, scale_2_log2: tuple[float, float] = (-4.0, 1.0),
               width: int | None = None) -> None:
    """The op on the experts in the form the model stores them (`stored`: kernel v3's ModelOpt
    forms at I = 704; v7's tiles once widened to `width`) against the reference at the
    checkpoint's width."""
    hidden, _, num_experts, top_k = shape
    experts = _fuzz_experts(shape, seed % 2, scale_2_log2)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    run = _stored_fuzz_experts(shape, seed % 2, scale_2_log2, width)
    assert_matches_reference(nvfp4_moe(*op_args(x, ids, w, run), activation=activation),
                             nvfp4_moe_reference(*op_args(x, ids, w, experts),
                                                 activation=activation))


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17]),
       shape=st.sampled_from([(32, 704, 16, 8), (48, 704, 128, 8)]),
       activation=st.sampled_from(ACTIVATIONS), skew=st.booleans())
def test_diffusiongemma_widths_match_reference_cpu(seed: int, tokens: int,
                                                   shape: tuple[int, int, int, int],
                                                   activation: str, skew: bool) -> None:
    """I = 704 (kernel v3), 128 experts, top-8, both activations, a narrow H (interpreted)."""
    _fuzz_case(seed, tokens, shape, activation, skew)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 5, 17]),
       shape=st.sampled_from([(128, 80, 4, 2), (128, 704, 16, 8)]),
       activation=st.sampled_from(ACTIVATIONS), skew=st.booleans())
def test_widened_experts_match_reference_cpu(seed: int, tokens: int,
                                             shape: tuple[int, int, int, int],
                                             activation: str, skew: bool) -> None:
    """Experts widened with zeros to the next multiple of 128 (kernel v7's tiles at H 128)
    compute what the checkpoint's width computes (interpreted)."""
    _fuzz_case(seed, tokens, shape, activation, skew, width=-(-shape[1] // 128) * 128)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 256), skew=st.booleans(),
       scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]))
def test_diffusiongemma_shapes_match_reference_gpu(seed: int, tokens: int, skew: bool,
                                                   scale_2_log2: tuple[float, float]) -> None:
    """DiffusionGemma's experts exactly (H 2816, I 704, 128 experts, top-8, gelu_tanh) as the
    model runs them, widened to 768 (kernel v7), against the reference at 704: 1 to 256
    tokens (a canvas), skewed routing and extreme global scales, 200 examples."""
    _fuzz_case(seed, tokens, DIFFUSIONGEMMA, "gelu_tanh", skew, scale_2_log2, width=768)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 256), skew=st.booleans(),
       scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]))
def test_diffusiongemma_checkpoint_width_matches_reference_gpu(
        seed: int, tokens: int, skew: bool, scale_2_log2: tuple[float, float]) -> None:
    """The same experts at the checkpoint's width 704 (kernel v3, `--no-nvfp4-pad-experts`)."""
    _fuzz_case(seed, tokens, DIFFUSIONGEMMA, "gelu_tanh", skew, scale_2_log2)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 256), skew=st.booleans())
def test_diffusiongemma_shapes_with_silu_match_reference_gpu(seed: int, tokens: int,
                                                             skew: bool) -> None:
    """The widened shapes under SiLU: the activation is the only difference."""
    _fuzz_case(seed, tokens, DIFFUSIONGEMMA, "silu", skew, width=768)


def _plan(activation: str, tokens: int = 32, inter: int = 512,
          shared: bool = False) -> launch._Plan:
    x = torch.empty(tokens, 2048, dtype=torch.bfloat16)
    return launch._plan(x, torch.zeros(tokens, 8, dtype=torch.int32), 256, inter, shared,
                        False, True, activation=activation)


def test_gelu_never_plans_the_gluon_gate_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an H200 with PDL, LLaDA2's shapes: SiLU runs both Gluon kernels without an
    alignment; GELU keeps the Gluon down kernel (activation-free) behind the Triton gate/up
    and an alignment launch."""
    gluon_on_cpu(monkeypatch)
    monkeypatch.setattr(launch, "overlap_active", lambda device, pdl: pdl)
    silu, gelu = _plan("silu"), _plan("gelu_tanh")
    assert (silu.gluon_down, silu.gluon_gate_up, silu.no_align) == (True, True, True)
    assert (gelu.gluon_down, gelu.gluon_gate_up, gelu.no_align) == (True, False, False)
    assert silu.tiles == gelu.tiles and gelu.tiles.block_m == 16


def test_gelu_with_the_gluon_down_wiring_matches_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """v7 shapes on the H200's plan (the Gluon down launch stood in by its reference on CPU):
    GELU's h from the Triton gate/up, stored even-odd for the Gluon down kernel."""
    from tests.custom_ops.test_nvfp4_down_gluon import torch_down

    gluon_on_cpu(monkeypatch)
    calls: list = []
    monkeypatch.setattr(launch, "launch_down_gluon", torch_down(calls))
    gen = torch.Generator().manual_seed(21)
    experts = random_experts(gen, 4, 128, 256)
    x = torch.randn(6, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 6, 4, 2, skew=False)
    args = op_args(x, ids, w, stored(experts))
    out = nvfp4_moe(*args, activation="gelu_tanh")
    assert calls  # the Gluon down launch ran
    ref = nvfp4_moe_reference(*op_args(x, ids, w, experts), activation="gelu_tanh")
    assert_matches_reference(out, ref)
    assert not torch.equal(ref, nvfp4_moe_reference(*op_args(x, ids, w, experts)))


def test_activation_errors_name_the_option() -> None:
    gen = torch.Generator().manual_seed(4)
    experts = random_experts(gen, 3, 32, 16)
    x = torch.randn(4, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    args = op_args(x, ids, w, experts)
    for fn in (nvfp4_moe, nvfp4_moe_reference):
        with pytest.raises(ValueError, match="activation='gelu'"):
            fn(*args, activation="gelu")
        with pytest.raises(ValueError, match="shared expert"):
            fn(*args, activation="gelu_tanh", **shared_expert(gen, x, x, 32, 16))
