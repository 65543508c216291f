"""NVFP4 block scales pre-decoded at load for kernel v4: E4M3 -> `bf16(scale * 2^119)`, exact.

Kernel v3 decodes each E4M3 block-scale byte in its main loop (`nvfp4_bf16x2.e4m3_bf16x2_pair`:
the byte's bits placed in fp16 bits give `scale * 2^-8`, times 2^127 in fp32, converted to bf16 in
both halves of a word) and every thread that shares the scale repeats it. v4 stores that bf16
value once, at load (2 bytes per 16 weights instead of 1), and only copies it into both halves of
the word in the main loop, so its products and sums are v3's bit for bit.

Exactness, every one of the 256 E4M3 codes (tests/custom_ops/test_nvfp4_scales.py):
- finite codes (±0, the subnormals `m * 2^-9`, normals up to 448) have at most 4 significant bits
  and become `scale * 2^119` in [2^110, 1.75 * 2^127]: normal bf16 numbers (7 fraction bits),
  so the conversion is exact and `e4m3_of_predecoded` inverts it; -0 stays -0;
- the NaN codes 0x7F / 0xFF: v3's bit placement reads them as ±480 (the exponent field 15 with
  mantissa 7 is an ordinary fp16 value), so v3 and v4 both scale such a block by ±480 where the
  reference (`float(scale)`) gives NaN. ModelOpt never writes them (its block scales are clamped
  to at most 448); `e4m3_of_predecoded` maps ±480 back to 0x7F / 0xFF.
"""

from __future__ import annotations

import torch

from dlmc.custom_ops.nvfp4_bf16x2 import SCALE_LOG2

__all__ = ["e4m3_of_predecoded", "predecode_block_scales"]

_NAN_AS = 480.0  # what v3's (and so v4's) bit placement makes of the E4M3 NaN codes


def predecode_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (float8_e4m3fn, or their uint8 bit patterns) `[...]` -> bf16 `[...]`
    holding `scale * 2^119` exactly: the value v3's main loop derives from each byte (the same
    integer steps as `e4m3_bf16x2_pair`, so NaN codes give ±480 * 2^119 as there)."""
    b = scale.view(torch.uint8).to(torch.int32)
    # s eeee mmm -> fp16 bits 15, 13..10, 9..7 (bit 15 as -2^15 so the int16 cast is exact)
    s16 = (((b & 0x7F) << 7) - ((b & 0x80) << 8)).to(torch.int16).view(torch.float16)
    return (s16.float() * 2.0 ** (SCALE_LOG2 + 8)).bfloat16()  # scale * 2^-8 * 2^127, exact


def e4m3_of_predecoded(predecoded: torch.Tensor) -> torch.Tensor:
    """Inverse of `predecode_block_scales`: bf16 `scale * 2^119` `[...]` -> float8_e4m3fn `[...]`,
    exact for every code (±480, the NaN codes' reading, back to 0x7F / 0xFF)."""
    value = predecoded.float() * 2.0**-SCALE_LOG2  # [...] fp32 E4M3 values, exact
    codes = value.to(torch.float8_e4m3fn).view(torch.uint8)
    nan_code = torch.where(value < 0, 0xFF, 0x7F).to(torch.uint8)
    return torch.where(value.abs() == _NAN_AS, nan_code, codes).view(torch.float8_e4m3fn)
