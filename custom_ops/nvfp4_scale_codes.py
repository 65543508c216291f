"""Kernel v7 block scales: one byte per 16 weights whose bf16x2 pair is one integer multiply-add.

v3 turns each E4M3 block-scale byte into the bf16x2 pair `bf16(scale * 2^119)` in both halves
with about five instructions (`nvfp4_bf16x2.e4m3_bf16x2_pair`), repeated by every thread that
shares the scale (`v3_scale_bf16` computes that value on the CPU, exactly). Here a positive
scale is stored as the byte `c` with

    bf16 bits of scale * 2^119 = 16 * c + 0x7680        (0x7680: the bits of 2^110 = 2^-9 * 2^119)
    pair = c * 0x100010 + 0x76807680                       (one IMAD: both halves at once)

which holds because every positive E4M3 value times 2^119 is a bf16 with exponent field
237..254 and at most 3 mantissa bits: `c = (exponent - 237) << 3 | mantissa >> 4`, 0..143 (the
subnormals 1..7 * 2^-9 included; the NaN codes as v3 reads them, 480).

Exactness of `bf16(scale * 2^119)`, every one of the 256 E4M3 codes: finite codes (±0, the
subnormals `m * 2^-9`, normals up to 448) have at most 4 significant bits and become normal bf16
numbers in [2^110, 1.75 * 2^127] (-0 stays -0), so `e4m3_of_v3_scale` inverts the conversion;
v3's bit placement reads the NaN codes 0x7F / 0xFF as ±480 (ModelOpt never writes them: its
block scales are at most 448), and `e4m3_of_v3_scale` maps ±480 back to them.

Negative and zero scales have no code: `encode_block_scales` folds them into the weights, exactly
(the same dequantized value for every weight, signed zeros included): a negative scale flips the
sign bit of its 16 E2M1 codes (`-w * s == w * -s`), a zero scale clears their magnitudes and
becomes 1.0 (`±0 * 1.0 == e2m1 * ±0` with the sign the product had). The module's weights are
then an equivalent encoding, not the checkpoint's bytes (`dequantize_to_bf16` is unchanged).
Stored form: int8 `[..., N, K/16]` codes (the dtype tells them from E4M3), tiled as
`nvfp4_words.tile_scales` tiles E4M3 bytes.
"""

from __future__ import annotations

import torch

from dlmc.custom_ops.nvfp4_bf16x2 import SCALE_LOG2

__all__ = ["PAIR_ADD", "PAIR_MUL", "decode_block_scales", "e4m3_of_v3_scale",
           "encode_block_scales", "scale_code_pairs_emulated", "v3_scale_bf16"]

CODE_BIAS = 0x7680  # bf16 bits of 2^110, the smallest positive E4M3 (2^-9) times 2^119
PAIR_MUL, PAIR_ADD = 0x100010, 0x76807680  # c * PAIR_MUL + PAIR_ADD = (16 c + CODE_BIAS) * 0x10001
MAX_CODE = 143  # 480 (the NaN codes as v3 reads them) * 2^119: exponent 254, mantissa 0x70
_ONE = 0x38  # E4M3 bits of 1.0
_NAN_AS = 480.0  # what v3's bit placement makes of the E4M3 NaN codes


def v3_scale_bf16(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (float8_e4m3fn, or their uint8 bit patterns) `[...]` -> bf16 `[...]`
    holding `scale * 2^119` exactly: the value v3's kernel derives from each byte (the same
    integer steps as `nvfp4_bf16x2.e4m3_bf16x2_pair`, so NaN codes give ±480 * 2^119)."""
    b = scale.view(torch.uint8).to(torch.int32)
    # s eeee mmm -> fp16 bits 15, 13..10, 9..7 (bit 15 as -2^15 so the int16 cast is exact)
    s16 = (((b & 0x7F) << 7) - ((b & 0x80) << 8)).to(torch.int16).view(torch.float16)
    return (s16.float() * 2.0 ** (SCALE_LOG2 + 8)).bfloat16()  # scale * 2^-8 * 2^127, exact


def e4m3_of_v3_scale(value: torch.Tensor) -> torch.Tensor:
    """Inverse of `v3_scale_bf16`: bf16 `scale * 2^119` `[...]` -> float8_e4m3fn `[...]`,
    exact for every code (±480, the NaN codes' reading, back to 0x7F / 0xFF)."""
    scale = value.float() * 2.0**-SCALE_LOG2  # [...] fp32 E4M3 values, exact
    codes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    nan_code = torch.where(scale < 0, 0xFF, 0x7F).to(torch.uint8)
    return torch.where(scale.abs() == _NAN_AS, nan_code, codes).view(torch.float8_e4m3fn)


def encode_block_scales(packed: torch.Tensor, scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt bytes `[..., N, K/2]` (uint8) and their E4M3 block scales `[..., N, K/16]` ->
    (bytes with negative / zero scales folded in, int8 codes `[..., N, K/16]`), exact."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"encode_block_scales: expected uint8 weights and float8_e4m3fn scales, "
                         f"got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 8 * scale.shape[-1]:
        raise ValueError(f"encode_block_scales: weights {tuple(packed.shape)} do not match "
                         f"block scales {tuple(scale.shape)} (8 bytes per scale)")
    bits = scale.view(torch.uint8)
    negative, zero = bits >= 0x80, (bits & 0x7F) == 0  # [..., N, K/16]
    magnitude = torch.where(zero, _ONE, bits & 0x7F).to(torch.uint8)
    b16 = v3_scale_bf16(magnitude).view(torch.int16).int()  # |scale| * 2^119, exact
    codes = (b16 - CODE_BIAS) >> 4
    assert bool(((b16 & 0xF) == 0).all() and (codes >= 0).all() and (codes <= MAX_CODE).all())
    blocks = packed.reshape(*scale.shape, 8)  # the 8 bytes (16 codes) of each scale
    flipped = torch.where(negative[..., None], blocks ^ 0x88, blocks)
    folded = torch.where(zero[..., None], flipped & 0x88, flipped)
    return folded.reshape(packed.shape), codes.to(torch.uint8).view(torch.int8)


def decode_block_scales(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -> float8_e4m3fn scales (exact; 480 -> the NaN code 0x7F, as v3 reads it)."""
    if codes.dtype != torch.int8:
        raise ValueError(f"decode_block_scales: expected int8 codes, got {codes.dtype}")
    b16 = (codes.view(torch.uint8).int() << 4) + CODE_BIAS
    return e4m3_of_v3_scale(b16.to(torch.int16).view(torch.bfloat16))


def scale_code_pairs_emulated(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's pair on the CPU: int8 codes -> int64 bf16x2 words (`c * PAIR_MUL +
    PAIR_ADD`), what `nvfp4_bf16x2.scale_pairs_emulated` gives for the decoded scale."""
    return (codes.view(torch.uint8).long() * PAIR_MUL + PAIR_ADD) & 0xFFFFFFFF
