"""NVFP4 numerics: E2M1 table, packing, rounding, exact dequantization, ModelOpt formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.quant.nvfp4_format import (
    E2M1_MAGNITUDES,
    dequantize_blocks,
    dequantize_nvfp4,
    e2m1_to_float,
    fake_quantize_activation,
    pack_e2m1,
    quantize_nvfp4,
    round_to_e2m1,
    unpack_e2m1,
)


def brute_force_e2m1(value: float) -> int:
    """Nearest magnitude, ties to the even index, saturating; sign bit = value < 0."""
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - m) for m in E2M1_MAGNITUDES]
    best = min(distances)
    index = [i for i, d in enumerate(distances) if d == best]
    chosen = next((i for i in index if i % 2 == 0), index[0])
    return chosen | (8 if value < 0 else 0)


def test_all_16_codes_decode() -> None:
    values = e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert values.tolist() == expected
    assert torch.signbit(values[8])  # code 8 is negative zero


def test_pack_low_nibble_first_and_round_trip() -> None:
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_e2m1(unpack_e2m1(all_bytes)), all_bytes)


def test_rounding_ties_to_even_and_saturation() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0])
    assert e2m1_to_float(round_to_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6]
    assert e2m1_to_float(round_to_e2m1(-ties)).tolist() == [-0.0, -1, -1, -2, -2, -4, -4, -6, -6]


def test_negative_zero() -> None:
    codes = round_to_e2m1(torch.tensor([-0.1, -0.0, 0.0, 0.1]))
    assert codes.tolist() == [8, 0, 0, 0]  # ModelOpt: sign bit is x < 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=64))
def test_rounding_matches_brute_force(values: list[float]) -> None:
    codes = round_to_e2m1(torch.tensor(values, dtype=torch.float32))
    assert codes.tolist() == [brute_force_e2m1(v) for v in values]


def test_dequantize_is_exact_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (8, 16), generator=gen, dtype=torch.uint8)  # all codes
    scale_bytes = torch.randint(0, 0x7F, (8, 2), generator=gen, dtype=torch.uint8)  # 2^-9..448
    scale = scale_bytes.view(torch.float8_e4m3fn)
    blocks = dequantize_blocks(packed, scale)
    codes = unpack_e2m1(packed)
    for r in range(8):
        for k in range(32):
            expected = E2M1_MAGNITUDES[codes[r, k] & 7] * float(scale[r, k // 16].float())
            expected = -expected if codes[r, k] & 8 else expected
            assert blocks[r, k].item() == expected
    assert torch.equal(blocks.bfloat16().float(), blocks)  # exact in bf16
    s2 = torch.tensor(0.375)
    assert torch.equal(dequantize_nvfp4(packed, scale, s2, torch.float32), blocks * 0.375)
    assert torch.equal(dequantize_nvfp4(packed, scale, s2), (blocks * 0.375).bfloat16())


def test_quantize_follows_modelopt_formulas() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 64, generator=gen) * torch.logspace(-6, 1, 16)[:, None]
    weight[3, :16] = 0  # an all-zero block gets scale 1.0
    weight = weight.bfloat16()
    packed, block_scale, s2 = quantize_nvfp4(weight)
    w = weight.float()
    assert s2.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-7)
    blk_amax = w.reshape(16, 4, 16).abs().amax(-1)
    raw = (blk_amax / (6 * s2)).clamp(2**-9, 448)
    raw[3, 0] = 1.0
    assert torch.equal(block_scale.float(), raw.to(torch.float8_e4m3fn).float())
    codes = unpack_e2m1(packed).reshape(16, 4, 16)
    scaled = w.reshape(16, 4, 16) / (block_scale.float() * s2)[..., None]
    for value, code in zip(scaled.flatten().tolist(), codes.flatten().tolist(), strict=True):
        assert code == brute_force_e2m1(value)
    deq = dequantize_nvfp4(packed, block_scale, s2, torch.float32)
    step = (block_scale.float() * s2).repeat_interleave(16, dim=1)
    # At most one unit (the 4 -> 6 gap / 2) where the block scale is a normal E4M3 number;
    # subnormal block scales are coarse (step 2^-9) and saturate, as in ModelOpt.
    normal = (block_scale.float() >= 2**-6).repeat_interleave(16, dim=1)
    assert normal.float().mean() > 0.5
    assert ((deq - w).abs()[normal] <= step[normal]).all()


def test_quantize_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="in % 16"):
        quantize_nvfp4(torch.ones(4, 24))


def test_fake_quantize_activation_formula() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=gen)
    input_scale = torch.tensor([0.01])
    out = fake_quantize_activation(x, input_scale).float()
    g = 1 / 0.01
    blocks = x.reshape(3, 2, 16)
    sx = (g * blocks.abs().amax(-1) / 6).to(torch.float8_e4m3fn).float()
    xq = e2m1_to_float(round_to_e2m1((blocks * g / sx[..., None]).clamp(-6, 6)))
    expected = (xq * sx[..., None]).reshape(3, 32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert ((out * 0.01 - x).abs() <= x.abs().amax() / 4 + 1e-6).all()
    assert fake_quantize_activation(torch.zeros(1, 16), input_scale).abs().sum() == 0
