"""`NVFP4Tiles` and `default_tiles`: the tiles of `dlmc::nvfp4_moe`'s Triton kernels.

Kernel v7's shapes (LLaDA2, DiffusionGemma widened) keep the routing's block sizes, and the
Gluon kernels only where an expert's pairs fit one 16-slot block; DiffusionGemma's canvas at
kernel v3 (~16 pairs per expert) takes one routing block per expert; any valid configuration
computes the reference's result (CPU: Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_moe_tiles import (
    NVFP4Tiles,
    block_m_for_many_pairs,
    default_tiles,
    gluon_fits,
)
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    gluon_on_cpu,
    op_args,
    random_experts,
    random_routing,
    run_case,
    stored,
)

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")]
CANVAS = NVFP4Tiles(block_m=32, gate_up_block_n=64, gate_up_block_k=128, down_block_n=128,
                    down_block_k=128, gate_up_warps=4, down_warps=4, num_stages=3)


@pytest.mark.parametrize("tokens", [1, 32, 33, 64, 128, 256, 512, 1024, 4096])
@pytest.mark.parametrize("shared", [False, True])
def test_llada2_shapes_keep_the_routing_blocks(tokens: int, shared: bool) -> None:
    """LLaDA2.1-mini (H 2048, I 512, 256 experts, top-8: kernel v7): blocks of 16 slots up to
    16 pairs per expert, 32 up to 48, then 64 (with the shared expert's pairs and expert in
    the routing: 512 tokens are 17.9 pairs per expert); the Gluon kernels' few pairs up to 128
    tokens; N-tiles and K-steps of 128; 4 warps, 3 stages."""
    tiles = default_tiles(tokens, 8, 256, 2048, 512, 7, shared)
    assert tiles.block_m == {1: 16, 32: 16, 33: 16, 64: 16, 128: 16, 256: 16,
                             512: 32 if shared else 16, 1024: 32, 4096: 64}[tokens]
    assert tiles == dataclasses.replace(CANVAS, block_m=tiles.block_m, gate_up_block_n=128)
    assert gluon_fits(tokens, 8, 256, shared) == (tokens <= 128)


def test_diffusiongemma_canvas_tiles() -> None:
    """256 tokens x top-8 over 128 experts (16 pairs per expert), H 2816: at I 704 (kernel v3)
    one 32-slot block per expert and v3's 64-column gate/up tiles; widened to I 768 (kernel
    v7) the routing's 16-slot blocks (the Triton kernels: too many pairs for the Gluon ones)
    and v7's 128-column gate/up tiles; K-steps of 128."""
    assert default_tiles(256, 8, 128, 2816, 704, 3) == CANVAS
    assert default_tiles(256, 8, 128, 2816, 768, 7) == dataclasses.replace(
        CANVAS, block_m=16, gate_up_block_n=128)
    assert not gluon_fits(256, 8, 128)
    assert default_tiles(32, 8, 128, 2816, 704, 3).block_m == 16  # 2 pairs per expert
    assert default_tiles(1024, 8, 128, 2816, 704, 3).block_m == 64  # a prompt chunk


def _tail(trials: int, p: float, above: int) -> float:
    """P(Binomial(trials, p) > above)."""
    return sum(math.comb(trials, k) * p**k * (1 - p) ** (trials - k)
               for k in range(above + 1, trials + 1))


def test_block_m_for_many_pairs_is_the_smallest_with_room() -> None:
    """The smallest of 16, 32, 64 at least `m + 3 sqrt(m)` (m pairs per expert), 64 past it;
    at the canvas, uniform routing sends more than 32 pairs to an expert with probability
    below 1e-4, more than 16 with probability above 0.4 (a second block: the expert's weights
    decoded twice)."""
    for pairs in range(1, 3000, 7):
        for experts in (1, 16, 128, 257):
            need = pairs / experts + 3 * math.sqrt(pairs / experts)
            want = next((b for b in (16, 32) if b >= need - 1e-9), 64)
            assert block_m_for_many_pairs(pairs, experts) == want, (pairs, experts)
    assert block_m_for_many_pairs(256 * 8, 128) == 32
    assert _tail(256, 8 / 128, 32) < 1e-4 < 0.4 < _tail(256, 8 / 128, 16)


def test_tiles_fields_are_checked_by_name() -> None:
    for field, bad in (("block_m", 24), ("gate_up_block_k", 16), ("down_warps", 3),
                       ("num_stages", 0), ("down_block_n", 256), ("block_m", 32.0)):
        with pytest.raises(ValueError, match=f"NVFP4Tiles.{field}="):
            dataclasses.replace(CANVAS, **{field: bad})
    assert NVFP4Tiles.from_list(CANVAS.as_list()) == CANVAS
    assert NVFP4Tiles.parse(CANVAS.describe(), dataclasses.replace(CANVAS, block_m=16)) == CANVAS
    assert NVFP4Tiles.parse("block_m=64, down_block_k=64", CANVAS) == dataclasses.replace(
        CANVAS, block_m=64, down_block_k=64)
    for text in ("block_m", "blockm=32", "block_m=x"):
        with pytest.raises(ValueError, match="name=integer"):
            NVFP4Tiles.parse(text, CANVAS)


@st.composite
def tiles(draw: st.DrawFn) -> NVFP4Tiles:
    pick = {"block_m": (16, 32, 64, 128), "gate_up_block_n": (16, 32, 64, 128),
            "gate_up_block_k": (32, 64, 128), "down_block_n": (16, 32, 64, 128),
            "down_block_k": (32, 64, 128), "gate_up_warps": (2, 4, 8), "down_warps": (2, 4, 8),
            "num_stages": (1, 2, 3, 4)}
    return NVFP4Tiles(**{name: draw(st.sampled_from(values)) for name, values in pick.items()})


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), config=tiles(), tokens=st.sampled_from([1, 5, 40, 70]),
       hidden=st.sampled_from([32, 48, 80]), inter=st.sampled_from([16, 48, 80, 704]),
       activation=st.sampled_from(["silu", "gelu_tanh"]), skew=st.booleans())
def test_any_tiles_match_reference(seed: int, config: NVFP4Tiles, tokens: int, hidden: int,
                                   inter: int, activation: str, skew: bool) -> None:
    """Every valid configuration, on kernel v3's shapes (K-steps longer than K, tails of I =
    704 and 80, blocks of up to 128 slots: skewed routing puts every token on experts 0-1)."""
    run_case(seed, tokens, 4, 2, hidden, inter, skew, activation=activation, tiles=config)


def test_tiles_on_kernel_v7_need_k_steps_of_128(monkeypatch: pytest.MonkeyPatch) -> None:
    """v7's stored forms with the op's tiles but 64-slot blocks match the reference; a
    K-step other than 128 is refused; passed tiles never plan a Gluon kernel."""
    gen = torch.Generator().manual_seed(3)
    experts = stored(random_experts(gen, 4, 128, 256))
    x = torch.randn(9, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 9, 4, 2, skew=True)
    args = op_args(x, ids, w, experts)
    base = default_tiles(9, 2, 4, 128, 256, 7)
    out = nvfp4_moe(*args, tiles=dataclasses.replace(base, block_m=64, num_stages=2))
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts)))
    with pytest.raises(ValueError, match="steps of 128"):
        nvfp4_moe(*args, tiles=dataclasses.replace(base, down_block_k=64))
    with pytest.raises(ValueError, match="NVFP4Tiles or None"):
        nvfp4_moe(*args, tiles=base.as_list())
    gluon_on_cpu(monkeypatch)
    plan = launch._plan(x, ids, 4, 256, False, False, True, tiles=base)
    assert (plan.gluon_down, plan.gluon_gate_up, plan.no_align) == (False, False, False)
    assert launch._plan(x, ids, 4, 256, False, False, True).gluon_down


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_opcheck_with_activation_and_tiles(activation: str) -> None:
    gen = torch.Generator().manual_seed(5)
    experts = random_experts(gen, 3, 32, 16)
    x = torch.randn(4, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    args = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for t in op_args(x, ids, w, experts)]  # the op takes the scales' bit patterns
    # (gate_up_input_scale, down_input_scale, shared_*, pairs, pdl, activation, tiles)
    args += [None, None, None, None, None, False, True, activation,
             dataclasses.replace(CANVAS, gate_up_block_k=32, down_block_n=32).as_list()]
    torch.library.opcheck(torch.ops.dlmc.nvfp4_moe.default, args)
