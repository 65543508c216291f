"""The v3 bf16x2 decode (`custom_ops/nvfp4_bf16x2.py`): the integer emulation is the spec the
inline asm must meet (CPU), and the asm meets it on the GPU (every code x extreme scales)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import (
    ACC_SCALE,
    SCALE_LOG2,
    decode_e2m1_bf16x2,
    decode_pairs_emulated,
    e4m3_bf16x2_pair,
    scale_pairs_emulated,
)
from dlmc.quant.nvfp4_format import e2m1_to_float

# E4M3 patterns: zero, every subnormal (2^-9 .. 7 * 2^-9), the smallest normal, 1.0, 1.125,
# a spread of normals, 448 (0x7E, the largest finite), and one negative scale (-1.5).
SCALE_BYTES = [0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x30, 0x38, 0x39,
               0x3F, 0x41, 0x55, 0x6A, 0x77, 0x7D, 0x7E, 0xBC]


def expected_weights(byte_values: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """bf16(e2m1 * scale * 2^-7) `[B, S, 2]` (low nibble, high nibble) for bytes `[B]`, scales
    `[S]`, computed in fp64 from the E2M1 table (exact)."""
    lo = e2m1_to_float(byte_values & 0xF).double()  # [B]
    hi = e2m1_to_float(byte_values >> 4).double()
    scale = scale_bytes.view(torch.float8_e4m3fn).double()  # [S]
    w = torch.stack([lo[:, None] * scale, hi[:, None] * scale], dim=-1) * 2.0 ** -(
        126 - SCALE_LOG2)
    assert torch.equal(w.bfloat16().double(), w)  # exact in bf16: the trick loses nothing
    return w.bfloat16()


def words_of(byte_values: torch.Tensor) -> torch.Tensor:
    """Bytes `[4N]` -> little-endian int64 words `[N]` (byte 0 in bits 0..7)."""
    b = byte_values.long().reshape(-1, 4)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def test_scale_pairs_hold_scale_times_2_119() -> None:
    scale_bytes = torch.tensor(SCALE_BYTES, dtype=torch.uint8)
    pairs = scale_pairs_emulated(scale_bytes)  # [S]
    assert torch.equal(pairs >> 16, pairs & 0xFFFF)
    bf = (pairs & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()
    scale = scale_bytes.view(torch.float8_e4m3fn).double()
    assert torch.equal(bf, scale * 2.0**SCALE_LOG2)
    assert bf[SCALE_BYTES.index(0x7E)] == 448 * 2.0**119 and bf[1] == 2.0 ** (119 - 9)


def test_emulated_decode_is_exact_for_every_byte_and_scale() -> None:
    """All 256 byte values x zero, subnormal, normal, 448 and negative scales, bit for bit."""
    byte_values = torch.arange(256, dtype=torch.uint8)  # [B]
    scale_bytes = torch.tensor(SCALE_BYTES, dtype=torch.uint8)  # [S]
    expected = expected_weights(byte_values, scale_bytes)  # [B, S, 2]
    words = words_of(byte_values)  # [64] words, bytes 4j..4j+3
    for s, scale_byte in enumerate(SCALE_BYTES):
        pairs = scale_pairs_emulated(torch.full((64,), scale_byte, dtype=torch.uint8))
        got = decode_pairs_emulated(words, pairs).reshape(256, 2)  # [B, (lo, hi)]
        want = expected[:, s]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), hex(scale_byte)
    # Spot values: code 1 (0.5) x the smallest subnormal scale, -6 x 448, and -0 stays -0.
    one = decode_pairs_emulated(words_of(torch.tensor([0x91, 0, 0, 0], dtype=torch.uint8)),
                                scale_pairs_emulated(torch.tensor([0x01], dtype=torch.uint8)))
    assert one[0, 0].item() == 0.5 * 2.0**-9 / ACC_SCALE.value
    assert one[0, 1].item() == -0.5 * 2.0**-9 / ACC_SCALE.value
    six = decode_pairs_emulated(words_of(torch.tensor([0xF8, 0, 0, 0], dtype=torch.uint8)),
                                scale_pairs_emulated(torch.tensor([0x7E], dtype=torch.uint8)))
    assert six[0, 1].item() == -6 * 448 / 128 and six[0, 0].view(torch.int16).item() == -32768


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    """out[i, 0/1] = v3 decode of byte i (low/high nibble) with scale byte i // 8's block."""
    i = tl.arange(0, N)
    pair = e4m3_bf16x2_pair(tl.load(scale_ptr + i // 8))
    lo, hi = decode_e2m1_bf16x2(tl.load(packed_ptr + i), pair)
    tl.store(out_ptr + 2 * i, lo)
    tl.store(out_ptr + 2 * i + 1, hi)


@pytest.mark.gpu
def test_asm_decode_matches_emulation_gpu() -> None:
    """Every byte value (so every code pair) x every scale in SCALE_BYTES, on the GPU."""
    byte_values = torch.arange(256, dtype=torch.uint8)
    for scale_byte in SCALE_BYTES:
        scales = torch.full((32,), scale_byte, dtype=torch.uint8)
        out = torch.empty(256, 2, dtype=torch.bfloat16, device="cuda")
        _decode_kernel[(1,)](byte_values.cuda(), scales.cuda(), out, N=256)
        want = expected_weights(byte_values, scales[:1])[:, 0]  # [256, 2]
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), hex(scale_byte)


@pytest.mark.gpu
def test_asm_decode_mixed_scales_gpu() -> None:
    """Random bytes with a different scale per 8-byte block (the kernel's grouping)."""
    gen = torch.Generator().manual_seed(0)
    byte_values = torch.randint(0, 256, (1024,), generator=gen, dtype=torch.uint8)
    scales = torch.tensor(SCALE_BYTES, dtype=torch.uint8)[
        torch.randint(0, len(SCALE_BYTES), (128,), generator=gen)]
    out = torch.empty(1024, 2, dtype=torch.bfloat16, device="cuda")
    _decode_kernel[(1,)](byte_values.cuda(), scales.cuda(), out, N=1024)
    lo = e2m1_to_float(byte_values & 0xF).double()
    hi = e2m1_to_float(byte_values >> 4).double()
    scale = scales.view(torch.float8_e4m3fn).double().repeat_interleave(8)
    want = (torch.stack([lo, hi], dim=-1) * scale[:, None] / 128).bfloat16()
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
