"""Block scales pre-decoded for kernel v4 (`custom_ops/nvfp4_scales.py`): every one of the 256
E4M3 codes gives exactly the value v3's main loop derives, and converts back (CPU); the v4 asm
decode equals v3's for every byte x every scale code (GPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import (
    SCALE_LOG2,
    decode_e2m1_bf16x2,
    decode_e2m1_bf16x2_predecoded,
    e4m3_bf16x2_pair,
    scale_pairs_emulated,
)
from dlmc.custom_ops.nvfp4_scales import (
    e4m3_of_predecoded,
    predecode_block_scales,
)

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every E4M3 bit pattern
NAN_CODES = (0x7F, 0xFF)


def v3_pair_emulated(codes: torch.Tensor) -> torch.Tensor:
    """`e4m3_bf16x2_pair`'s steps on int64: sign-extend, `(b << 7) & 0xBF80` as fp16 bits,
    x 2^127 in fp32, RNE to bf16 (cvt.rn.bf16x2) -> the bf16 bit pattern (one half)."""
    b = codes.view(torch.int8).long()  # sign-extended
    bits = (b << 7) & 0xBF80
    s16 = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.float16)
    scaled = s16.float() * 1.7014118346046923e38
    return scaled.bfloat16().view(torch.int16).long() & 0xFFFF


def test_every_code_is_exactly_v3s_value() -> None:
    predecoded = predecode_block_scales(CODES.view(torch.float8_e4m3fn))  # [256] bf16
    assert predecoded.dtype == torch.bfloat16
    bits = predecoded.view(torch.int16).long() & 0xFFFF
    assert torch.equal(bits, v3_pair_emulated(CODES))  # bit for bit, all 256 codes
    value = predecoded.double()
    scale = CODES.view(torch.float8_e4m3fn).double()  # NaN for 0x7F / 0xFF
    finite = torch.isfinite(scale)
    assert int(finite.sum()) == 254
    assert torch.equal(value[finite], scale[finite] * 2.0**SCALE_LOG2)  # exact
    # -0 stays -0; every nonzero value is a normal bf16 (biased exponent 1..254)
    assert bits[0x00] == 0 and bits[0x80] == 0x8000
    exponent = (bits >> 7) & 0xFF
    nonzero = (bits & 0x7FFF) != 0
    assert bool(((exponent >= 1) & (exponent <= 254))[nonzero].all())
    assert value[0x01] == 2.0 ** (SCALE_LOG2 - 9) and value[0x7E] == 448 * 2.0**SCALE_LOG2
    # NaN codes: v3 (and so v4) reads them as +-480; the reference's float(scale) is NaN
    assert value[0x7F] == 480 * 2.0**SCALE_LOG2 and value[0xFF] == -480 * 2.0**SCALE_LOG2
    # the CPU spec of v3's pair agrees wherever it is defined (it decodes through float8)
    pairs = scale_pairs_emulated(CODES)
    assert torch.equal((pairs & 0xFFFF)[finite], bits[finite])


def test_round_trip() -> None:
    e4m3 = CODES.view(torch.float8_e4m3fn)
    predecoded = predecode_block_scales(e4m3)
    back = e4m3_of_predecoded(predecoded)
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), CODES)  # all 256, NaN codes included
    grid, grid_bf16 = e4m3.reshape(4, 8, 8), predecoded.reshape(4, 8, 8)
    assert torch.equal(predecode_block_scales(grid.view(torch.uint8)), grid_bf16)


@triton.jit
def _v3_pair_kernel(scale_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_bf16x2_pair(tl.load(scale_ptr + i)))


@triton.jit
def _decode_both_kernel(packed_ptr, scale_ptr, predecoded_ptr, out3_ptr, out4_ptr,
                        N: tl.constexpr):
    """Byte i decoded with block i // 8's scale, v3 (E4M3 byte) and v4 (pre-decoded bf16);
    N bytes per program."""
    i = tl.program_id(0) * N + tl.arange(0, N)
    packed = tl.load(packed_ptr + i)
    lo3, hi3 = decode_e2m1_bf16x2(packed, e4m3_bf16x2_pair(tl.load(scale_ptr + i // 8)))
    lo4, hi4 = decode_e2m1_bf16x2_predecoded(packed, tl.load(predecoded_ptr + i // 8))
    tl.store(out3_ptr + 2 * i, lo3)
    tl.store(out3_ptr + 2 * i + 1, hi3)
    tl.store(out4_ptr + 2 * i, lo4)
    tl.store(out4_ptr + 2 * i + 1, hi4)


@pytest.mark.gpu
def test_predecoded_equals_v3_pair_on_gpu() -> None:
    """The GPU's own v3 scale decode (both halves) for every code equals the load-time value."""
    out = torch.empty(256, dtype=torch.int32, device="cuda")
    _v3_pair_kernel[(1,)](CODES.cuda(), out, N=256)
    word = out.cpu().long() & 0xFFFFFFFF
    bits = predecode_block_scales(CODES).view(torch.int16).long() & 0xFFFF
    assert torch.equal(word & 0xFFFF, bits) and torch.equal(word >> 16, bits)


@pytest.mark.gpu
def test_v4_decode_equals_v3_for_every_byte_and_scale_gpu() -> None:
    """All 256 byte values x all 256 scale codes (NaN codes too), bit for bit."""
    byte_values = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256)  # [65536]
    scales = CODES.repeat_interleave(32)  # [8192]: each code covers 32 blocks = 256 bytes
    predecoded = predecode_block_scales(scales).view(torch.int16)
    out3 = torch.empty(65536, 2, dtype=torch.bfloat16, device="cuda")
    out4 = torch.empty_like(out3)
    _decode_both_kernel[(64,)](byte_values.cuda(), scales.cuda(), predecoded.cuda(), out3, out4,
                               N=1024)
    assert torch.equal(out3.view(torch.int16), out4.view(torch.int16))
