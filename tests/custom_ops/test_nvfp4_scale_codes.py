"""`nvfp4_scale_codes`: kernel v7's one-byte block scales. Every E4M3 code (negative, zero,
subnormal, NaN) with every weight byte decodes to v3's products bit for bit, through the one
multiply-add pair the kernel builds."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.nvfp4_bf16x2 import decode_pairs_emulated
from dlmc.custom_ops.nvfp4_scale_codes import (
    MAX_CODE,
    PAIR_ADD,
    PAIR_MUL,
    decode_block_scales,
    encode_block_scales,
    scale_code_pairs_emulated,
)
from dlmc.custom_ops.nvfp4_scales import predecode_block_scales

ALL = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def little_endian_words(b: torch.Tensor) -> torch.Tensor:
    b = b.long()
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def v3_pairs(scale_bits: torch.Tensor) -> torch.Tensor:
    """What v3's kernel multiplies by: bf16(scale * 2^119) in both halves (NaN codes as 480)."""
    half = predecode_block_scales(scale_bits).view(torch.int16).long() & 0xFFFF
    return half | (half << 16)


def test_every_scale_with_every_byte_decodes_as_v3() -> None:
    scales = ALL.repeat_interleave(256)  # [65536]: each E4M3 code ...
    blocks = torch.stack([ALL.repeat(256).roll(i) for i in range(8)], dim=1)  # ... x each byte
    folded, codes = encode_block_scales(blocks, scales[:, None].view(torch.float8_e4m3fn))
    assert codes.dtype == torch.int8 and int(codes.view(torch.uint8).max()) == MAX_CODE
    for half in (slice(0, 4), slice(4, 8)):
        v3 = decode_pairs_emulated(little_endian_words(blocks[:, half]), v3_pairs(scales))
        v7 = decode_pairs_emulated(little_endian_words(folded[:, half]),
                                   scale_code_pairs_emulated(codes[:, 0]))
        assert torch.equal(v7.view(torch.int16), v3.view(torch.int16))
    untouched = (scales & 0x7F != 0) & (scales < 0x80)  # positive scales keep their bytes
    assert torch.equal(folded[untouched], blocks[untouched])


def test_codes_decode_to_the_scales_and_the_pair_is_the_bf16_pair() -> None:
    positive = ALL[(ALL > 0) & (ALL < 0x80)]  # 1 .. 0x7F, the NaN code 0x7F included
    blocks = torch.zeros(positive.numel(), 8, dtype=torch.uint8)
    _, codes = encode_block_scales(blocks, positive[:, None].view(torch.float8_e4m3fn))
    assert torch.equal(decode_block_scales(codes).view(torch.uint8)[:, 0], positive)
    assert torch.equal(scale_code_pairs_emulated(codes[:, 0]), v3_pairs(positive))
    assert (PAIR_MUL, PAIR_ADD) == (0x100010, 0x76807680)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="encode_block_scales: expected uint8 weights"):
        encode_block_scales(torch.zeros(2, 8, dtype=torch.int8),
                            torch.zeros(2, 1).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="do not match block scales"):
        encode_block_scales(torch.zeros(2, 16, dtype=torch.uint8),
                            torch.zeros(2, 1).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="decode_block_scales: expected int8"):
        decode_block_scales(torch.zeros(3, dtype=torch.uint8))
