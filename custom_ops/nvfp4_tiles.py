"""Triton device functions for NVFP4 weights: exact E2M1/E4M3 decoding and a W4A16 tile dot.

`INTERPRETED` (constexpr): Triton 3.6's CPU interpreter multiplies bf16 as raw uint16 and truncates
fp32 -> bf16, so interpreted kernels dot in fp32 (exact for these operands) and round by hand.
"""

import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import (
    decode_e2m1_bf16x2,
    decode_e2m1_bf16x2_predecoded,
    e4m3_bf16x2_pair,
)
from dlmc.custom_ops.nvfp4_scale_codes import PAIR_ADD, PAIR_MUL
from dlmc.custom_ops.nvfp4_words import ROWS, decode_e2m1_words, decode_e2m1_words_predecoded

_PAIR_MUL, _PAIR_ADD = tl.constexpr(PAIR_MUL), tl.constexpr(PAIR_ADD)  # v7's scale-code pair
_ROWS = tl.constexpr(ROWS)  # rows per contiguous run of the tiled layout (`nvfp4_words`)


@triton.jit
def e2m1_scaled_down(codes):
    """E2M1 codes (low 4 bits) -> fp32 `e2m1 * 2^-14`, exact.

    s|ee|m is placed in fp16 bits (exponent field ee, mantissa top bit m): the fp16 value is the
    E2M1 value times 2^-14, subnormal (code 1 -> 0.5) included.
    """
    c = codes.to(tl.int16)
    return (((c & 0x7) << 9) | ((c & 0x8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)


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
def nvfp4_tile_dot(acc, a_ptr, a_rows, row_mask, stride_a, w_ptr, s_ptr, n_offs, n_mask,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc[BM, BN] += A[rows, :K] @ W[n, :K]^T with W packed `[N, K/2]`, scales `[N, K/16]`.

    v1 (measured on the H200, perf/results): K-major weight tiles, so the compiler emits one byte
    load per packed byte and one gathered scale byte per weight.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    j = tl.arange(0, HALF)
    for k0 in range(0, K, BLOCK_K):
        kbyte = k0 // 2 + j  # [HALF] byte index along K/2
        kmask = kbyte < K // 2
        a_base = a_ptr + a_rows[:, None] * stride_a + 2 * kbyte[None, :]
        amask = row_mask[:, None] & kmask[None, :]
        a_even = tl.load(a_base, mask=amask, other=0.0)  # [BM, HALF]
        a_odd = tl.load(a_base + 1, mask=amask, other=0.0)  # [BM, HALF]
        wmask = kmask[:, None] & n_mask[None, :]
        packed = tl.load(w_ptr + n_offs[None, :] * (K // 2) + kbyte[:, None], mask=wmask,
                         other=0)  # [HALF, BN]
        scale = e4m3_scaled_up(tl.load(
            s_ptr + n_offs[None, :] * (K // 16) + (kbyte // 8)[:, None], mask=wmask,
            other=0))  # [HALF, BN], one gathered byte per weight
        w_lo = (e2m1_scaled_down(packed & 0xF) * scale).to(tl.bfloat16)
        w_hi = (e2m1_scaled_down(packed >> 4) * scale).to(tl.bfloat16)
        if INTERPRETED:  # the interpreter's bf16 dot is wrong; fp32 is exact here
            a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
            w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
        acc = tl.dot(a_even, w_lo, acc)
        acc = tl.dot(a_odd, w_hi, acc)
    return acc


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
    each) and their block-scale bit patterns `[BN, BK/16]`. `TILED` (v5-v7; BLOCK_K 128, N % R
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
    # fp16 bit patterns (as in e2m1_scaled_down) built straight from the byte for both nibbles.
    lo16 = (((byte << 9) & 0x0E00) | ((byte << 12) & 0x8000)).to(tl.int16)
    hi16 = (((byte << 5) & 0x0E00) | ((byte << 8) & 0x8000)).to(tl.int16)
    w_lo = (lo16.to(tl.float16, bitcast=True).to(tl.float32) * scale3).to(tl.bfloat16)
    w_hi = (hi16.to(tl.float16, bitcast=True).to(tl.float32) * scale3).to(tl.bfloat16)
    return (tl.trans(tl.reshape(w_lo, (BLOCK_N, HALF))),
            tl.trans(tl.reshape(w_hi, (BLOCK_N, HALF))))


@triton.jit
def _load_w_split(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PREDECODED: tl.constexpr, TILED: tl.constexpr):
    """Low/high-nibble weight tiles `[BK/2, BN]` bf16 (exact), loaded N-major (K contiguous),
    one scale decode per 16-weight block: E4M3 bytes, or (`PREDECODED`, v4) int16 bit patterns
    of `bf16(scale * 2^119)` made `scale * 2^14` by two exact fp32 steps."""
    packed, scale_bits = _load_w_bytes(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                       TILED)
    if PREDECODED:
        scale = (scale_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True) * 2.0**-105
    else:
        scale = e4m3_scaled_up(scale_bits)
    return _split_tiles(packed, scale, BLOCK_N, BLOCK_K)


@triton.jit
def _load_w_split_v3(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PREDECODED: tl.constexpr, WORDS: tl.constexpr,
                     CODES: tl.constexpr):
    """`_load_w_split` with the bf16x2 decode: tiles `[BK/2, BN]` of `w * 2^-7` (exact). The
    scale pair comes from the E4M3 byte (v3, v5) or from the pre-decoded bf16 (`PREDECODED`, v4,
    v6); `WORDS` (v5-v7): `nvfp4_words`' tiled words (chunked loads, shorter asm); `CODES`
    (v7): the scale bytes are `nvfp4_scale_codes`' codes, whose pair is one multiply-add."""
    HALF: tl.constexpr = BLOCK_K // 2
    BLOCKS: tl.constexpr = BLOCK_K // 16
    packed, scale_bits = _load_w_bytes(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                       WORDS)
    if PREDECODED:  # the asm reads the 16-bit scales in place (no pair to build)
        scale = tl.broadcast_to(scale_bits[:, :, None], (BLOCK_N, BLOCKS, 8))
        if WORDS:
            w_lo, w_hi = decode_e2m1_words_predecoded(packed, scale)
        else:
            w_lo, w_hi = decode_e2m1_bf16x2_predecoded(packed, scale)
    else:
        if CODES:
            pair = scale_bits.to(tl.int32) * _PAIR_MUL + _PAIR_ADD  # bf16(scale * 2^119) x2
        else:
            pair = e4m3_bf16x2_pair(scale_bits)
        pair = tl.broadcast_to(pair[:, :, None], (BLOCK_N, BLOCKS, 8))
        if WORDS:
            w_lo, w_hi = decode_e2m1_words(packed, pair)
        else:
            w_lo, w_hi = decode_e2m1_bf16x2(packed, pair)
    return (tl.trans(tl.reshape(w_lo, (BLOCK_N, HALF))),
            tl.trans(tl.reshape(w_hi, (BLOCK_N, HALF))))


@triton.jit
def _load_w_tiles(w_ptr, s_ptr, n_offs, n_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, VARIANT: tl.constexpr):
    """Low/high-nibble weight tiles: the bf16x2 inline-asm decode (`w * 2^-7`) for `VARIANT` 3
    to 6 when compiled, else `_load_w_split` (exact; widened to fp32 under the interpreter,
    which gets ModelOpt's bits for every variant, tiled for v5-v7). v4/v6's scales are
    pre-decoded (`nvfp4_scales`), v2/v3/v5 read E4M3 bytes, v7 `nvfp4_scale_codes`' bytes
    (E4M3 under the interpreter); v5-v7 read `nvfp4_words`' tiled layout (words when
    compiled)."""
    PREDECODED: tl.constexpr = VARIANT == 4 or VARIANT == 6
    if VARIANT >= 3 and not INTERPRETED:
        w_lo, w_hi = _load_w_split_v3(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                      PREDECODED, VARIANT >= 5, VARIANT == 7)
    else:
        w_lo, w_hi = _load_w_split(w_ptr, s_ptr, n_offs, n_mask, k0, K, BLOCK_N, BLOCK_K,
                                   PREDECODED, VARIANT >= 5)
        if INTERPRETED:
            w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
    return w_lo, w_hi


@triton.jit
def nvfp4_tile_dot_v2(acc0, acc1, a_ptr, a_rows, row_mask, stride_a, w0_ptr, s0_ptr, w1_ptr,
                      s1_ptr, n_offs, n_mask, K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, DUAL: tl.constexpr,
                      VARIANT: tl.constexpr):
    """Like `nvfp4_tile_dot` for one (`DUAL=False`) or two weight matrices sharing the A loads.

    Vectorized N-major weight loads, scales decoded once per 16 weights, A loaded contiguously
    and split in registers. `VARIANT` 3 and 4: the inline-asm decode of `nvfp4_bf16x2` (v4 with
    the block scales pre-decoded, `nvfp4_scales`); the compiled accumulators then hold the result
    times 2^-7 (`nvfp4_bf16x2.ACC_SCALE`). `VARIANT` 2: the decode of `_load_w_split`.
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

