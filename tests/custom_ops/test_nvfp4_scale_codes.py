"""`nvfp4_scale_codes`: kernel v7's one-byte block scales. Every one of the 256 E4M3 codes gives
exactly the bf16 scale v3's kernel derives and converts back; every E4M3 code (negative, zero,
subnormal, NaN) with every weight byte decodes to v3's products bit for bit, through the one
multiply-add pair the kernel builds (CPU); v3's own scale decode on the GPU gives the same bf16
scale."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import (
    SCALE_LOG2,
    decode_pairs_emulated,
    e4m3_bf16x2_pair,
    scale_pairs_emulated,
)
from dlmc.custom_ops.nvfp4_scale_codes import (
    MAX_CODE,
    PAIR_ADD,
    PAIR_MUL,
    decode_block_scales,
    e4m3_of_v3_scale,
    encode_block_scales,
    scale_code_pairs_emulated,
    v3_scale_bf16,
)

ALL = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every E4M3 bit pattern


def v3_pair_emulated(codes: torch.Tensor) -> torch.Tensor:
    """`e4m3_bf16x2_pair`'s steps on int64: sign-extend, `(b << 7) & 0xBF80` as fp16 bits,
    x 2^127 in fp32, RNE to bf16 (cvt.rn.bf16x2) -> the bf16 bit pattern (one half)."""
    b = codes.view(torch.int8).long()  # sign-extended
    bits = (b << 7) & 0xBF80
    s16 = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.float16)
    scaled = s16.float() * 1.7014118346046923e38
    return scaled.bfloat16().view(torch.int16).long() & 0xFFFF


def test_every_code_is_exactly_v3s_value() -> None:
    scaled = v3_scale_bf16(ALL.view(torch.float8_e4m3fn))  # [256] bf16
    assert scaled.dtype == torch.bfloat16
    bits = scaled.view(torch.int16).long() & 0xFFFF
    assert torch.equal(bits, v3_pair_emulated(ALL))  # bit for bit, all 256 codes
    value = scaled.double()
    scale = ALL.view(torch.float8_e4m3fn).double()  # NaN for 0x7F / 0xFF
    finite = torch.isfinite(scale)
    assert int(finite.sum()) == 254
    assert torch.equal(value[finite], scale[finite] * 2.0**SCALE_LOG2)  # exact
    # -0 stays -0; every nonzero value is a normal bf16 (biased exponent 1..254)
    assert bits[0x00] == 0 and bits[0x80] == 0x8000
    exponent = (bits >> 7) & 0xFF
    nonzero = (bits & 0x7FFF) != 0
    assert bool(((exponent >= 1) & (exponent <= 254))[nonzero].all())
    assert value[0x01] == 2.0 ** (SCALE_LOG2 - 9) and value[0x7E] == 448 * 2.0**SCALE_LOG2
    # NaN codes: v3 reads them as +-480; the reference's float(scale) is NaN
    assert value[0x7F] == 480 * 2.0**SCALE_LOG2 and value[0xFF] == -480 * 2.0**SCALE_LOG2
    # the CPU spec of v3's pair agrees wherever it is defined (it decodes through float8)
    pairs = scale_pairs_emulated(ALL)
    assert torch.equal((pairs & 0xFFFF)[finite], bits[finite])


def test_bf16_scales_convert_back_exactly() -> None:
    e4m3 = ALL.view(torch.float8_e4m3fn)
    scaled = v3_scale_bf16(e4m3)
    back = e4m3_of_v3_scale(scaled)
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), ALL)  # all 256, NaN codes included
    grid, grid_bf16 = e4m3.reshape(4, 8, 8), scaled.reshape(4, 8, 8)
    assert torch.equal(v3_scale_bf16(grid.view(torch.uint8)), grid_bf16)


def little_endian_words(b: torch.Tensor) -> torch.Tensor:
    b = b.long()
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def v3_pairs(scale_bits: torch.Tensor) -> torch.Tensor:
    """What v3's kernel multiplies by: bf16(scale * 2^119) in both halves (NaN codes as 480)."""
    half = v3_scale_bf16(scale_bits).view(torch.int16).long() & 0xFFFF
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


@triton.jit
def _v3_pair_kernel(scale_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_bf16x2_pair(tl.load(scale_ptr + i)))


@pytest.mark.gpu
def test_v3_pair_on_the_gpu_is_the_bf16_scale_gpu() -> None:
    """The GPU's own v3 scale decode (both halves) for every code equals `v3_scale_bf16`."""
    out = torch.empty(256, dtype=torch.int32, device="cuda")
    _v3_pair_kernel[(1,)](ALL.cuda(), out, N=256)
    word = out.cpu().long() & 0xFFFFFFFF
    bits = v3_scale_bf16(ALL).view(torch.int16).long() & 0xFFFF
    assert torch.equal(word & 0xFFFF, bits) and torch.equal(word >> 16, bits)
