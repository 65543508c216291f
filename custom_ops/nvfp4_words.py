"""Kernel v7's NVFP4 weight layout, made once at load: each 128 rows x 128 K of a weight matrix
one contiguous 8 KB chunk, and the bits of 8 E2M1 codes arranged per 32-bit word so that the
bf16x2 decode takes 8 integer instructions per 8 weights (v3: 14).

Chunks. ModelOpt's row-major bytes give a program 64 bytes per row per 128-K tile, rows 1 KB
apart (gate/up): scattered 64-byte reads. Tiled, one program's tile (BLOCK_N = ROWS = 128) is one
run of 128 x 64 bytes; block scales likewise (128 x 8 codes per run). The arrangement of a
`[..., N, C]` tensor keeps its shape: rows grouped by ROWS, each group's columns cut into runs of
C_RUN (64 weight bytes, 16 words, 8 scales), run r of group g at `[R g : R g + R]` flattened
position `(g * C / C_RUN + r) * R * C_RUN`. It needs N % 128 == 0 and K % 128 == 0 (`can_pack`);
other shapes keep ModelOpt's layout and run kernel v3.

Words. v3 decodes ModelOpt's packing (low nibble = even element) with 2 `prmt` and 3 integer
ops per bf16x2 pair. Here each pair's bits sit where one or two ops put them at bf16 bits 15
(sign) and 8, 7, 6 (e1 e0 m) of both halves (`nvfp4_bf16x2`'s exact `e2m1 * 2^-126`):

    pair 0: q & P                        (its bits stored at P itself)
    pair 1: rotr(q, 3) & P               (stored at P + 3, mod 32)
    pair 2: rotr(q, 6) & P               (stored at P + 6, mod 32)
    pair 3: ((q & L) * 0x1084) & P       (stored at L; x 0x1084 = shifts by 2, 7 and 12 whose
                                          copies of L never overlap, so no carries)

with P = 0x81C081C0 and L the 8 bits left over; then `mul.rn.bf16x2` by the block-scale pair as
in v3. The pairs are v3's asm outputs (`nvfp4_bf16x2.DECODE_ASM`): the word of ModelOpt bytes
b0..b3 holds codes c0..c7 in K order (c2i = low nibble of b_i); pair 0 = (c0, c2), 1 = (c4, c6),
2 = (c1, c3), 3 = (c5, c7), first element in the low half. Same products as v3, bit for bit.

Stored forms (the dtype tells them from ModelOpt's): weights int32 words `[..., N, K/8]`
(`pack_weight_words`) with `nvfp4_scale_codes`' int8 codes `[..., N, K/16]`, both tiled
(`stored_forms`). `weight_operand` / `scale_operand` give any kernel the form it reads, exactly.
`decode_words_emulated` is the asm's spec on the CPU (tests/custom_ops/test_nvfp4_words.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops.nvfp4_bf16x2 import BF16_MASK, _bf16x2_mul
from dlmc.custom_ops.nvfp4_scale_codes import decode_block_scales, encode_block_scales

__all__ = ["can_pack", "e4m3_scales", "pack_weight_words", "projection_operands", "scale_operand",
           "stored_forms", "tile_scales", "unpack_weight_words", "untile_scales",
           "weight_operand"]

# One chunk: ROWS rows x 128 K (64 weight bytes, 8 scales per row), contiguous. Every shape the
# layout takes has N and K both multiples of 128 (gate/up's N is down's K and the other way
# round), so 128-row runs exclude none; a program's K-tile at BLOCK_N 128 is one run.
ROWS, CHUNK_K = 128, 128

ROT_1, ROT_2 = 3, 6  # pairs 1 and 2: right-rotations of the word
MUL_MASK, MUL = 0x001B001B, 0x1084  # pair 3: L = bits 0,1,3,4,16,17,19,20; shifts 2, 7, 12
# (code index within the word, [(code bit, bf16x2 target bit)] of its sign, e1, e0, m)
_PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))  # codes of pair j: (low half, high half)
_TARGET = {3: 15, 2: 8, 1: 7, 0: 6}  # code bit -> bf16 bit in the low half (+16: high half)
# Pair 3's storage bit of each target bit (found by search: L shifted by 2, 7, 12 hits P once)
_PAIR3_SOURCE = {7: 0, 8: 1, 15: 3, 6: 4, 23: 16, 24: 17, 31: 19, 22: 20}


def _storage_map() -> list[tuple[int, int, int]]:
    """[(storage bit, code index 0..7, code bit 0..3)] for all 32 bits of a word."""
    out = []
    for j, codes in enumerate(_PAIRS):
        for half, code in enumerate(codes):
            for code_bit, target in _TARGET.items():
                t = target + 16 * half
                src = _PAIR3_SOURCE[t] if j == 3 else (t + (0, ROT_1, ROT_2)[j]) % 32
                out.append((src, code, code_bit))
    assert sorted(s for s, _, _ in out) == list(range(32)), "layout must use every bit once"
    return out


STORAGE_MAP = _storage_map()


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ModelOpt bytes `[..., K/2]` (K/2 % 4 == 0) -> int32 codes `[..., K/8, 8]` K order."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], 8)


def can_pack(n: int, k: int) -> bool:
    """Whether an `[n, k]` weight matrix can take this layout (ROWS-row x 128-K chunks)."""
    return n % ROWS == 0 and k % CHUNK_K == 0


def _tile(t: torch.Tensor, run: int) -> torch.Tensor:
    """`[..., N, C]` -> the same shape, rows grouped by ROWS and columns cut into runs of `run`,
    each (group, run) contiguous, runs of a group consecutive."""
    *lead, n, c = t.shape
    grouped = t.reshape(*lead, n // ROWS, ROWS, c // run, run).transpose(-3, -2)
    return grouped.contiguous().reshape(*lead, n, c)


def _untile(t: torch.Tensor, run: int) -> torch.Tensor:
    *lead, n, c = t.shape
    grouped = t.reshape(*lead, n // ROWS, c // run, ROWS, run).transpose(-3, -2)
    return grouped.contiguous().reshape(*lead, n, c)


def _check_packable(name: str, t: torch.Tensor, k_per_col: int) -> None:
    if t.dim() < 2:
        raise ValueError(f"{name}: needs [..., N, ...], got {t.dtype} {tuple(t.shape)}")
    n, k = t.shape[-2], t.shape[-1] * k_per_col
    if not can_pack(n, k):
        raise ValueError(f"{name}: needs [..., N, ...] with N % {ROWS} == 0 and K % {CHUNK_K} == 0"
                         f", got {t.dtype} {tuple(t.shape)} (N={n}, K={k})")


def pack_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ModelOpt bytes `[..., K/2]` (K/2 % 4 == 0) -> int32 words `[..., K/8]` in the word
    bit layout, not tiled (exact)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"pack_bits: expected uint8 [..., K/2] with K/2 % 4 == 0, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    codes = _codes(packed)  # [..., K/8, 8]
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=packed.device)
    for src, code, code_bit in STORAGE_MAP:
        word |= ((codes[..., code] >> code_bit) & 1).long() << src
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_bits`: int32 words `[..., K/8]` -> uint8 bytes `[..., K/2]`."""
    if words.dtype != torch.int32:
        raise ValueError(f"unpack_bits: expected int32 words, got {words.dtype}")
    w = words.long() & 0xFFFFFFFF
    codes = torch.zeros((*w.shape, 8), dtype=torch.int64, device=words.device)
    for src, code, code_bit in STORAGE_MAP:
        codes[..., code] |= ((w >> src) & 1) << code_bit
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., K/8, 4] bytes
    return packed.reshape(*w.shape[:-1], w.shape[-1] * 4).to(torch.uint8)


def pack_weight_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ModelOpt NVFP4 bytes `[..., N, K/2]` -> int32 words `[..., N, K/8]`, tiled (exact)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"pack_weight_words: expected uint8 ModelOpt bytes, got {packed.dtype}")
    _check_packable("pack_weight_words", packed, 2)
    return _tile(pack_bits(packed), CHUNK_K // 8)


def unpack_weight_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_weight_words`: int32 `[..., N, K/8]` -> uint8 ModelOpt bytes."""
    if words.dtype != torch.int32:
        raise ValueError(f"unpack_weight_words: expected int32 words, got {words.dtype}")
    _check_packable("unpack_weight_words", words, 8)
    return unpack_bits(_untile(words, CHUNK_K // 8))


def tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn block scales `[..., N, K/16]` -> their uint8 bit patterns, tiled (what
    the interpreted kernel v7 reads next to `weight_operand(..., "tiled")`)."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"tile_scales: expected float8_e4m3fn block scales, got {scale.dtype}")
    _check_packable("tile_scales", scale, 16)
    return _tile(scale.view(torch.uint8), CHUNK_K // 16)


def untile_scales(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of `tile_scales`: uint8 -> float8_e4m3fn `[..., N, K/16]`."""
    if tiled.dtype != torch.uint8:
        raise ValueError(f"untile_scales: expected uint8 tiled scales, got {tiled.dtype}")
    _check_packable("untile_scales", tiled, 16)
    return _untile(tiled, CHUNK_K // 16).view(torch.float8_e4m3fn)


def weight_operand(weight: torch.Tensor, form: str) -> torch.Tensor:
    """A weight matrix in any stored form (uint8 ModelOpt bytes, int32 tiled words) as the op
    operand `form` names, exactly: "plain" (ModelOpt bytes: kernel v3 and the reference),
    "words" (the tiled words viewed as uint8: v7 compiled) or "tiled" (ModelOpt's bits in the
    tiled arrangement: v7 under the interpreter, which decodes bytes)."""
    if form == "words":  # the stored words themselves: a free view (no per-call work)
        words = weight if weight.dtype == torch.int32 else pack_weight_words(weight)
        return words.view(torch.uint8)
    if form not in ("plain", "tiled"):
        raise ValueError(f"weight_operand: form must be plain, words or tiled, got {form!r}")
    plain = unpack_weight_words(weight) if weight.dtype == torch.int32 else weight
    return plain if form == "plain" else _tile(plain, CHUNK_K // 2)


def scale_operand(scale: torch.Tensor, tiled: bool) -> torch.Tensor:
    """Block scales in any stored form (float8_e4m3fn, or v7's tiled int8 codes) as the op
    operand: uint8 E4M3 bit patterns, in the tiled arrangement when `tiled`. Exact; float8
    scales asked for untiled are a view (no per-call work). v7's codes decode to the positive
    scales their folded weights go with: pass those weights along (the module stores both;
    `projection_operands` converts a pair)."""
    if scale.dtype == torch.int8:
        _check_packable("scale_operand", scale, 16)
        scale = decode_block_scales(_untile(scale, CHUNK_K // 16))
    elif scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scale_operand: expected float8_e4m3fn scales or int8 codes, got "
                         f"{scale.dtype}")
    return tile_scales(scale) if tiled else scale.view(torch.uint8)


def e4m3_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales in any stored form as plain float8_e4m3fn `[..., N, K/16]` (exact): what
    the reference and the exact dequantization read."""
    return scale_operand(scale, tiled=False).view(torch.float8_e4m3fn)


def stored_forms(weight: torch.Tensor, scale: torch.Tensor, variant: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's weights and block scales, in any stored form, as the module stores them
    for kernel `variant`: 3, ModelOpt's (uint8, float8_e4m3fn); 7 (a shape the tiled layout
    takes), tiled words with `nvfp4_scale_codes`' int8 codes (negative and zero scales folded
    into the words). Exact: every form dequantizes to the same weights."""
    if variant == 3:
        return weight_operand(weight, "plain"), e4m3_scales(scale)
    if variant != 7:
        raise ValueError(f"stored_forms: variant must be 3 or 7, got {variant}")
    if weight.dtype == torch.int32 and scale.dtype == torch.int8:
        return weight, scale
    folded, codes = encode_block_scales(weight_operand(weight, "plain"), e4m3_scales(scale))
    return pack_weight_words(folded), _tile(codes, CHUNK_K // 16)


def projection_operands(weight: torch.Tensor, scale: torch.Tensor, variant: int,
                        interpreted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's operands for one projection (uint8 weight bytes, uint8 scale bytes) in the form
    kernel `variant` reads: under the interpreter (`interpreted`) v7 reads ModelOpt's bits
    tiled and E4M3 scales (the plain Triton decode). Views of the stored forms `stored_forms`
    makes, else converted exactly."""
    if variant == 7 and not interpreted:
        words, codes = stored_forms(weight, scale, 7)
        return words.view(torch.uint8), codes.view(torch.uint8)
    tiled = variant == 7
    return weight_operand(weight, "tiled" if tiled else "plain"), scale_operand(scale, tiled)


def _pair_ops(out: str, j: int) -> str:
    if j == 0:
        return f"and.b32 {out}, $4, {BF16_MASK:#010x};"
    if j in (1, 2):
        return (f"shf.r.wrap.b32 m, $4, $4, {(0, ROT_1, ROT_2)[j]};"
                f"and.b32 {out}, m, {BF16_MASK:#010x};")
    return (f"and.b32 m, $4, {MUL_MASK:#010x};"
            f"mul.lo.u32 m, m, {MUL:#06x};"
            f"and.b32 {out}, m, {BF16_MASK:#010x};")


# One line (Inductor copies it into Python source). pack=4 operands as in `DECODE_ASM`: $0..$3
# the pairs, $4 the word, $5 the scale pair.
DECODE_WORDS_ASM = tl.constexpr(
    "{ .reg .b32 m;" + "".join(_pair_ops(f"${j}", j) for j in range(4))
    + "".join(f"mul.rn.bf16x2 ${j}, ${j}, $5;" for j in range(4)) + " }")


@triton.jit
def decode_e2m1_words(packed, scale_pair):
    """v7 word bytes (uint8, groups of 4 along the last dim) and their blocks' scale pairs (int32,
    same shape) -> (low-nibble, high-nibble) bf16 `e2m1 * scale * 2^-7` as `decode_e2m1_bf16x2`
    gives them for ModelOpt bytes."""
    return tl.inline_asm_elementwise(
        DECODE_WORDS_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale_pair],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


def decode_words_emulated(words: torch.Tensor, scale_pairs: torch.Tensor) -> torch.Tensor:
    """`DECODE_WORDS_ASM` on the CPU, same constants and ops: int64 words `[N]` and scale pairs
    `[N]` -> bf16 `[N, 8]` in K order (`e2m1 * scale * 2^-7`), `decode_pairs_emulated`'s result
    for the same weights in ModelOpt bytes."""
    q = words & 0xFFFFFFFF

    def rotr(x: torch.Tensor, s: int) -> torch.Tensor:
        return ((x >> s) | (x << (32 - s))) & 0xFFFFFFFF

    pairs = [q & BF16_MASK, rotr(q, ROT_1) & BF16_MASK, rotr(q, ROT_2) & BF16_MASK,
             (((q & MUL_MASK) * MUL) & 0xFFFFFFFF) & BF16_MASK]
    out = [_bf16x2_mul(p, scale_pairs) for p in pairs]
    (c0, c2), (c4, c6), (c1, c3), (c5, c7) = out
    return torch.stack([c0, c1, c2, c3, c4, c5, c6, c7], dim=-1)  # [N, 8]
