"""Triton device functions for NVFP4 weights: exact E4M3 decoding and a W4A16 tile dot.

Kernel v3 reads ModelOpt's bytes and E4M3 block scales; kernel v7 reads `nvfp4_words`' tiled
words and `nvfp4_scale_codes`' one-byte codes. Compiled, both decode with inline asm
(`nvfp4_bf16x2`, `nvfp4_words`); Triton's CPU interpreter cannot run inline asm, so interpreted
kernels decode with plain Triton ops (`_load_w_split`), from ModelOpt's bits (tiled for v7).
`INTERPRETED` (constexpr): Triton 3.6's CPU interpreter multiplies bf16 as raw uint16 and truncates
fp32 -> bf16, so interpreted kernels dot in fp32 (exact for these operands) and round by hand.
"""

import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import decode_e2m1_bf16x2, e4m3_bf16x2_pair
from dlmc.custom_ops.nvfp4_scale_codes import PAIR_ADD, PAIR_MUL
from dlmc.custom_ops.nvfp4_words import ROWS, decode_e2m1_words

_PAIR_MUL, _PAIR_ADD = tl.constexpr(PAIR_MUL), tl.constexpr(PAIR_ADD)  # v7's scale-code pair
_ROWS = tl.constexpr(ROWS)  # rows per contiguous run of the tiled layout (`nvfp4_words`)


@triton.jit
def e4m3_scaled_up(scale_bytes):
    """E4M3 bit patterns (uint8) -> fp32 `scale * 2^14`, exact (placed in fp16 bits: x 2^22)."""
    b = scale_bytes.to(tl.int16)
    s16 = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    return s16.to(tl.float32) * 4194304.0


@triton.jit
def round_bf16(x, INTERPRETED: tl.constexpr):
    """fp32 -> bf16, round to nearest even (by hand under the interpreter, which truncates)."""
    if INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _load_a_split(a_ptr, a_rows, row_mask, stride_a, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """A[rows, k0:k0+BK] loaded contiguously, split into even/odd columns `[BM, BK/2]` each."""
    k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :],
                mask=row_mask[:, None] & (k < K)[None, :], other=0.0)  # [BM, BK]
    return tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))


@triton.jit
def _load_w_bytes(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TILED: tl.constexpr):
    """One K-tile of packed weights, N-major (K contiguous): bytes `[BN, BK/16, 8]` (two codes
    each) and their block-scale bit patterns `[BN, BK/16]`. `TILED` (v7; BLOCK_K 128, N % R
    == 0, K % 128 == 0, R = `nvfp4_words.ROWS`): `nvfp4_words`' chunks, a row's tile at
    `(n // R) * R * K/2 + (k0 / 128) * R * 64 + (n % R) * 64` (scales: / 8), so R rows read
    R * 64 bytes in one run."""
    HALF: tl.constexpr = BLOCK_K // 2
    BLOCKS: tl.constexpr = BLOCK_K // 16
    if TILED:
        tl.static_assert(BLOCK_K == 128, "the tiled layout's chunks are 128 K wide")
        row = (n_offs // _ROWS) * (_ROWS * (K // 2)) + (n_offs % _ROWS) * HALF  # [BN]
        packed = tl.load(w_ptr + row[:, None] + (k0 // 128) * (_ROWS * HALF)
                         + tl.arange(0, HALF)[None, :], mask=n_mask[:, None], other=0)
        srow = (n_offs // _ROWS) * (_ROWS * (K // 16)) + (n_offs % _ROWS) * BLOCKS  # [BN]
        scale_bytes = tl.load(s_ptr + srow[:, None] + (k0 // 128) * (_ROWS * BLOCKS)
                              + tl.arange(0, BLOCKS)[None, :], mask=n_mask[:, None], other=0)
    else:
        kbyte = k0 // 2 + tl.arange(0, HALF)
        packed = tl.load(w_ptr + n_offs[:, None] * (K // 2) + kbyte[None, :],
                         mask=n_mask[:, None] & (kbyte < K // 2)[None, :], other=0)  # [BN, HALF]
        kb = k0 // 16 + tl.arange(0, BLOCKS)
        scale_bytes = tl.load(s_ptr + n_offs[:, None] * (K // 16) + kb[None, :],
                              mask=n_mask[:, None] & (kb < K // 16)[None, :], other=0)
    return tl.reshape(packed, (BLOCK_N, BLOCKS, 8)), scale_bytes


@triton.jit
def _split_tiles(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes `[BN, BK/16, 8]` and fp32 block scales `scale * 2^14` `[BN, BK/16]` ->
    low/high-nibble weight tiles `[BK/2, BN]` bf16 (exact)."""
    HALF: tl.constexpr = BLOCK_K // 2
    byte = packed.to(tl.int32)
    scale3 = scale[:, :, None]  # [BN, BLOCKS, 1]
    # fp16 bit patterns of `e2m1 * 2^-14` (s|ee|m at bits 15, 11-10, 9) straight from the byte
    lo16 = (((byte << 9) & 0x0E00) | ((byte << 12) & 0x8000)).to(tl.int16)
    hi16 = (((byte << 5) & 0x0E00) | ((byte << 8) & 0x8000)).to(tl.int16)
    w_lo = (lo16.to(tl.float16, bitcast=True).to(tl.float32) * scale3).to(tl.bfloat16)
    w_hi = (hi16.to(tl.float16, bitcast=True).to(tl.float32) * scale3).to(tl.bfloat16)
    return (tl.trans(tl.reshape(w_lo, (BLOCK_N, HALF))),
            tl.trans(tl.reshape(w_hi, (BLOCK_N, HALF))))


@triton.jit
def _load_w_split(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TILED: tl.constexpr):
    """Low/high-nibble weight tiles `[BK/2, BN]` bf16 (exact) in plain Triton ops (what the
    interpreter runs), loaded N-major (K contiguous), one E4M3 decode per 16-weight block."""
    packed, scale_bits = _load_w_bytes(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                       TILED)
    return _split_tiles(packed, e4m3_scaled_up(scale_bits), BLOCK_N, BLOCK_K)


@triton.jit
def _load_w_asm(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, V7: tl.constexpr):
    """`_load_w_split` with the bf16x2 inline-asm decode: tiles `[BK/2, BN]` of `w * 2^-7`
    (exact). v3: ModelOpt's bytes, the scale pair from the E4M3 byte; `V7`: `nvfp4_words`' tiled
    words (chunked loads, shorter asm) and `nvfp4_scale_codes`' codes, whose pair is one
    multiply-add."""
    BLOCKS: tl.constexpr = BLOCK_K // 16
    HALF: tl.constexpr = BLOCK_K // 2
    packed, scale_bits = _load_w_bytes(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                       V7)
    if V7:  # noqa: SIM108 (a static choice: one of the two is compiled)
        pair = scale_bits.to(tl.int32) * _PAIR_MUL + _PAIR_ADD  # bf16(scale * 2^119) x2
    else:
        pair = e4m3_bf16x2_pair(scale_bits)
    pair = tl.broadcast_to(pair[:, :, None], (BLOCK_N, BLOCKS, 8))
    if V7:
        w_lo, w_hi = decode_e2m1_words(packed, pair)
    else:
        w_lo, w_hi = decode_e2m1_bf16x2(packed, pair)
    return (tl.trans(tl.reshape(w_lo, (BLOCK_N, HALF))),
            tl.trans(tl.reshape(w_hi, (BLOCK_N, HALF))))


@triton.jit
def _load_w_tiles(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, VARIANT: tl.constexpr):
    """Low/high-nibble weight tiles of kernel `VARIANT` (3 or 7): the inline-asm decode
    (`w * 2^-7`) when compiled, else `_load_w_split` (exact, widened to fp32; v7's operands are
    then ModelOpt's bits tiled and E4M3 scales, `nvfp4_words.projection_operands`)."""
    if not INTERPRETED:
        w_lo, w_hi = _load_w_asm(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                 VARIANT == 7)
    else:
        w_lo, w_hi = _load_w_split(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                   VARIANT == 7)
        w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
    return w_lo, w_hi


@triton.jit
def nvfp4_tile_dot(acc0, acc1, a_ptr, a_rows, row_mask, stride_a, w0_ptr, s0_ptr, w1_ptr, s1_ptr,
                   n_offs, n_mask, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, DUAL: tl.constexpr,
                   VARIANT: tl.constexpr):
    """acc0 += A[rows, :K] @ W0[n, :K]^T (and with `DUAL` acc1 += A @ W1^T, sharing the A loads)
    for packed weights `[N, K/2]` and block scales `[N, K/16]` in kernel `VARIANT`'s form.

    N-major weight loads, scales decoded once per 16 weights, A loaded contiguously and split in
    registers into its even and odd columns (the low and high nibbles' operands). Compiled, the
    accumulators hold the result times 2^-7 (`nvfp4_bf16x2.ACC_SCALE`).
    """
    for k0 in range(0, K, BLOCK_K):
        a_even, a_odd = _load_a_split(a_ptr, a_rows, row_mask, stride_a, k0, K, BLOCK_K)
        if INTERPRETED:
            a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
        w_lo, w_hi = _load_w_tiles(w0_ptr, s0_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                   INTERPRETED, VARIANT)
        acc0 = tl.dot(a_even, w_lo, acc0)
        acc0 = tl.dot(a_odd, w_hi, acc0)
        if DUAL:
            w_lo, w_hi = _load_w_tiles(w1_ptr, s1_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                       INTERPRETED, VARIANT)
            acc1 = tl.dot(a_even, w_lo, acc1)
            acc1 = tl.dot(a_odd, w_hi, acc1)
    return acc0, acc1
