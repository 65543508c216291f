"""v3 NVFP4 weight decode: two E2M1 weights per 32-bit instruction, straight to scaled BF16.

The "magic" bf16 decode needs no conversions. An E2M1 nibble `s e1 e0 m` placed at bf16 bits
15 (sign) and 8, 7, 6 (value) reads as exactly `e2m1 * 2^-126` (codes 0/1, i.e. 0 and 0.5, become
bf16 subnormals, still exact). One `mul.rn.bf16x2` by the block scale pre-decoded to
`bf16(scale * 2^119)` then gives `e2m1 * scale * 2^-7` for two weights at once, exact (at most 6
significant bits, at least 2^-17, at most 21); the kernel multiplies its fp32 accumulator by 2^7
in the epilogue. Per 4 packed bytes (8 weights):

    t01 = prmt(x, 0x0504)  -> [b0, 0, b1, 0]        t23 = prmt(x, 0x0706) -> [b2, 0, b3, 0]
    lo pair = ((t & 0x000F000F) * 0x1040) & 0x81C081C0      (low nibble: even K element)
    hi pair = ((t & 0x00F000F0) * 0x0104) & 0x81C081C0      (high nibble: odd K element)
    w = mul.rn.bf16x2(pair, scale_pair)

`decode_pairs_emulated` runs the same integer ops on int64 tensors (and the bf16 multiply in fp32,
exact, then RNE to bf16): it is the spec the inline asm must meet (tests/custom_ops). The asm needs
bf16 subnormal inputs kept (PTX `mul.bf16x2` has no `.ftz` form; SASS `HMUL2.BF16_V2` without
`.FTZ`): the GPU tests decode every code with code 1 (0.5) among them.
The tile loop and loaders live in `nvfp4_tiles` (`nvfp4_tile_dot(..., VARIANT=3)`).
`tl.inline_asm_elementwise` cannot run under `TRITON_INTERPRET=1`; interpreted kernels decode
with plain Triton ops there instead (`nvfp4_tiles._load_w_split`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PRMT_LOW = 0x0504  # prmt selectors with the word as bytes 4..7 and zero as bytes 0..3
PRMT_HIGH = 0x0706
LO_MASK, LO_MUL = 0x000F000F, 0x1040  # nibble bits 0..3 -> 6..9 and 12..15 of each half
HI_MASK, HI_MUL = 0x00F000F0, 0x0104  # nibble bits 4..7 -> 6..9 and 12..15 of each half
BF16_MASK = 0x81C081C0  # keep bf16 bits 15 (sign) and 8..6 (e1 e0 m) of each half
SCALE_LOG2 = 119  # block scale pre-multiplied by 2^119; products are w * 2^-7
ACC_SCALE = tl.constexpr(128.0)  # the epilogue's factor back: 2^(126 - 119)


def _pair_asm(out: str, t: str, mask: int, mul: int) -> str:
    return (f"and.b32 m, {t}, {mask:#010x};"
            f"mul.lo.u32 m, m, {mul:#06x};"
            f"and.b32 m, m, {BF16_MASK:#010x};"
            f"mul.rn.bf16x2 {out}, m, $5;")


# One line (no newlines): Inductor copies this constant into its generated Python source, where
# a newline inside the string literal is a syntax error.
# pack=4: $0/$1 low-nibble bf16 pairs (bytes 0,1 / 2,3), $2/$3 high-nibble pairs, $4 the four
# packed bytes, $5..$8 the bf16x2 scale pair (the same value four times; only $5 is read).
DECODE_ASM = tl.constexpr("{ .reg .b32 t01, t23, m;"
              f"prmt.b32 t01, 0, $4, {PRMT_LOW:#06x};"
              f"prmt.b32 t23, 0, $4, {PRMT_HIGH:#06x};"
              + _pair_asm("$0", "t01", LO_MASK, LO_MUL) + _pair_asm("$1", "t23", LO_MASK, LO_MUL)
              + _pair_asm("$2", "t01", HI_MASK, HI_MUL) + _pair_asm("$3", "t23", HI_MASK, HI_MUL)
              + " }")


@triton.jit
def e4m3_bf16x2_pair(scale_bytes):
    """E4M3 bit patterns (uint8) -> int32 holding `bf16(scale * 2^119)` in both halves, exact."""
    b = scale_bytes.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: bit 15 = sign below
    s16 = ((b << 7) & 0xBF80).to(tl.int16).to(tl.float16, bitcast=True)  # scale * 2^-8
    scaled = s16.to(tl.float32) * 1.7014118346046923e38  # x 2^127, exact
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,r", [scaled],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def decode_e2m1_bf16x2(packed, scale_pair):
    """Packed bytes (uint8, any shape) and their blocks' scale pairs (int32, same shape) ->
    (low-nibble, high-nibble) bf16 weights `e2m1 * scale * 2^-7`, two per instruction."""
    return tl.inline_asm_elementwise(
        DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale_pair],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


def scale_pairs_emulated(scale_bytes: torch.Tensor) -> torch.Tensor:
    """`e4m3_bf16x2_pair` on the CPU: uint8 E4M3 patterns -> int64 bf16x2 words."""
    scale = scale_bytes.view(torch.float8_e4m3fn).float() * 2.0**SCALE_LOG2  # exact in fp32
    half = scale.bfloat16().view(torch.int16).long() & 0xFFFF
    return half | (half << 16)


def _bf16x2_mul(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mul.rn.bf16x2` (subnormals kept): int64 words -> (low, high) bf16 products."""
    def half(word: torch.Tensor, shift: int) -> torch.Tensor:
        bits = ((word >> shift) & 0xFFFF) << 16  # bf16 -> fp32 bit pattern
        return bits.to(torch.int32).view(torch.float32)

    # bf16 x bf16 has at most 16 significant bits: exact in fp32, then one RNE to bf16.
    return ((half(a, 0) * half(b, 0)).bfloat16(), (half(a, 16) * half(b, 16)).bfloat16())


def decode_pairs_emulated(words: torch.Tensor, scale_pairs: torch.Tensor) -> torch.Tensor:
    """`DECODE_ASM` on the CPU, same constants and ops: int64 words of 4 packed bytes `[N]` and
    scale pairs `[N]` -> bf16 `[N, 8]` in K order (`e2m1 * scale * 2^-7` per weight)."""
    x = words & 0xFFFFFFFF

    def prmt_spread(byte_a: int, byte_b: int) -> torch.Tensor:  # [b_a, 0, b_b, 0]
        return ((x >> (8 * byte_a)) & 0xFF) | (((x >> (8 * byte_b)) & 0xFF) << 16)

    assert (PRMT_LOW, PRMT_HIGH) == (0x0504, 0x0706)  # the selectors prmt_spread emulates
    t01, t23 = prmt_spread(0, 1), prmt_spread(2, 3)
    out = []
    for t, mask, mul in ((t01, LO_MASK, LO_MUL), (t23, LO_MASK, LO_MUL),
                         (t01, HI_MASK, HI_MUL), (t23, HI_MASK, HI_MUL)):
        pair = (((t & mask) * mul) & 0xFFFFFFFF) & BF16_MASK
        out.append(_bf16x2_mul(pair, scale_pairs))
    (lo0, lo1), (lo2, lo3), (hi0, hi1), (hi2, hi3) = out
    return torch.stack([lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3], dim=-1)  # [N, 8]
