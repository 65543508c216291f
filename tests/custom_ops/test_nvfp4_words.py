"""`nvfp4_words`: kernel v7's weight layout. Exact both ways, every code at every position, and
its decode (the asm's CPU spec) equal bit for bit to v3's decode of the ModelOpt bytes."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.nvfp4_bf16x2 import (
    BF16_MASK,
    decode_pairs_emulated,
    scale_pairs_emulated,
)
from dlmc.custom_ops.nvfp4_words import (
    DECODE_WORDS_ASM,
    MUL,
    MUL_MASK,
    ROWS,
    STORAGE_MAP,
    can_pack,
    decode_words_emulated,
    e4m3_scales,
    pack_bits,
    pack_weight_words,
    projection_operands,
    scale_operand,
    stored_forms,
    tile_scales,
    unpack_bits,
    unpack_weight_words,
    untile_scales,
    weight_operand,
)


def every_code_everywhere() -> torch.Tensor:
    """uint8 ModelOpt bytes `[16 * 8 * 16, 4]`: each of the 8 positions of a word holds each of
    the 16 codes, next to every code at the other positions (by a cyclic pattern)."""
    rows = []
    for pos in range(8):
        for code in range(16):
            for other in range(16):
                codes = [(other + 3 * i) % 16 for i in range(8)]
                codes[pos] = code
                rows.append([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(4)])
    return torch.tensor(rows, dtype=torch.uint8)


def words_of_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, 4]` -> int64 little-endian words `[N]` (the ModelOpt bytes v3's asm reads)."""
    b = b.long()
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def test_layout_uses_each_bit_once_and_the_multiply_never_carries() -> None:
    assert sorted(src for src, _, _ in STORAGE_MAP) == list(range(32))
    assert sorted((code, bit) for _, code, bit in STORAGE_MAP) == [
        (c, b) for c in range(8) for b in range(4)]
    # pair 3: the copies of L shifted by MUL's set bits are disjoint (no carry can form)
    shifts = [s for s in range(32) if MUL >> s & 1]
    copies = [(MUL_MASK << s) & 0xFFFFFFFF for s in shifts]
    assert len(shifts) == 3 and all(copies[i] & copies[j] == 0
                                    for i in range(3) for j in range(i + 1, 3))
    assert f"{BF16_MASK:#010x}" in DECODE_WORDS_ASM.value


def test_bit_pack_round_trip_is_exact() -> None:
    everything = every_code_everywhere()
    assert torch.equal(unpack_bits(pack_bits(everything)), everything)


def test_tiled_words_round_trip_and_chunks() -> None:
    """[N, K/2] bytes -> tiled words: exact both ways; each `rows` rows x 128 K are one run
    (rows x 64 bytes) in row order, runs of a row group consecutive."""
    rows = ROWS
    gen = torch.Generator().manual_seed(0)
    plain = torch.randint(0, 256, (3, 2 * rows, 128), dtype=torch.uint8, generator=gen)  # K 256
    words = pack_weight_words(plain)
    assert words.dtype == torch.int32 and words.shape == (3, 2 * rows, 32)
    assert torch.equal(unpack_weight_words(words), plain)
    flat = words.reshape(3, -1)  # [E, 64 * rows words] per expert
    for group, run in ((0, 0), (0, 1), (1, 0), (1, 1)):
        start = (group * 2 + run) * rows * 16  # runs of `rows` rows x 16 words
        chunk = flat[:, start:start + rows * 16].reshape(3, rows, 16)
        expected = plain[:, rows * group:rows * group + rows, 64 * run:64 * run + 64]
        assert torch.equal(unpack_bits(chunk), expected)
    assert torch.equal(weight_operand(words, "plain"), plain)
    assert weight_operand(plain, "plain") is plain
    assert torch.equal(weight_operand(plain, "words"), words.view(torch.uint8))
    assert torch.equal(weight_operand(words, "words"), words.view(torch.uint8))
    tiled = weight_operand(words, "tiled")  # ModelOpt's bits, tiled: the interpreter's operand
    assert torch.equal(tiled.reshape(3, -1)[:, :64 * rows].reshape(3, rows, 64),
                      plain[:, :rows, :64])
    assert torch.equal(weight_operand(plain, "tiled"), tiled)


def test_scale_forms_convert_exactly() -> None:
    rows = ROWS
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (2, rows, 16), dtype=torch.uint8, generator=gen)
    e4m3 = codes.view(torch.float8_e4m3fn)
    tiled = tile_scales(e4m3)
    assert tiled.dtype == torch.uint8
    assert torch.equal(tiled.reshape(2, -1)[:, :8 * rows].reshape(2, rows, 8), codes[:, :, :8])
    assert torch.equal(untile_scales(tiled).view(torch.uint8), codes)
    assert torch.equal(scale_operand(e4m3, tiled=False), codes)
    assert torch.equal(scale_operand(e4m3, tiled=True), tiled)
    # v7's codes (scales of positive bytes: negative and zero ones fold into the weights)
    positive = torch.where((codes & 0x7F) == 0, 0x38, codes & 0x7F).view(torch.float8_e4m3fn)
    words, scale_codes = stored_forms(torch.zeros(2, rows, 128, dtype=torch.uint8), positive, 7)
    assert scale_codes.dtype == torch.int8 and words.dtype == torch.int32
    assert torch.equal(scale_operand(scale_codes, tiled=False), positive.view(torch.uint8))
    assert torch.equal(scale_operand(scale_codes, tiled=True), tile_scales(positive))
    assert torch.equal(e4m3_scales(scale_codes).view(torch.uint8), positive.view(torch.uint8))


def test_words_decode_equals_v3_decode_bit_for_bit() -> None:
    everything = every_code_everywhere()  # [2048, 4]
    gen = torch.Generator().manual_seed(1)
    scale_bytes = torch.randint(0, 256, (everything.shape[0],), dtype=torch.uint8, generator=gen)
    scale_bytes[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every E4M3 code
    pairs = scale_pairs_emulated(scale_bytes)
    v3 = decode_pairs_emulated(words_of_bytes(everything), pairs)
    v7 = decode_words_emulated(pack_bits(everything).reshape(-1).long(), pairs)
    assert torch.equal(v7.view(torch.int16), v3.view(torch.int16))
    assert (v3.float().abs() > 0).any()  # not all zeros (NaN scale codes give NaN rows)


def test_bad_input_is_named() -> None:
    rows = ROWS
    with pytest.raises(ValueError, match="pack_bits: expected uint8"):
        pack_bits(torch.zeros(2, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="K/2 % 4 == 0"):
        pack_bits(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError,
                       match=rf"pack_weight_words: needs .* N % {rows} == 0 and K % 128"):
        pack_weight_words(torch.zeros(rows, 32, dtype=torch.uint8))  # K = 64
    with pytest.raises(ValueError, match=r"pack_weight_words: needs \[\.\.\., N, \.\.\.\], got"):
        pack_weight_words(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack_weight_words: expected int32"):
        unpack_weight_words(torch.zeros(16, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="tile_scales: expected float8_e4m3fn block scales"):
        tile_scales(torch.zeros(16, 8))
    with pytest.raises(ValueError, match="weight_operand: form must be"):
        weight_operand(torch.zeros(16, 64, dtype=torch.uint8), "packed")
    assert can_pack(512, 2048) and can_pack(2048, 512) and not can_pack(2816, 704)


def test_stored_forms_the_kernel_reads_pass_through_without_copies() -> None:
    """Per call the op asks for the form the module stored: a view, never a repack (a copy
    here would be captured into every graph round)."""
    gen = torch.Generator().manual_seed(5)
    plain = torch.randint(0, 256, (2, ROWS, 128), dtype=torch.uint8, generator=gen)
    e4m3 = torch.randint(0, 0x7F, (2, ROWS, 16), dtype=torch.uint8, generator=gen)
    words, codes = stored_forms(plain, e4m3.view(torch.float8_e4m3fn), 7)
    assert weight_operand(words, "words").data_ptr() == words.data_ptr()
    assert scale_operand(e4m3.view(torch.float8_e4m3fn), tiled=False).data_ptr() == (
        e4m3.data_ptr())
    for operand, stored in zip(projection_operands(words, codes, 7, False), (words, codes),
                               strict=True):
        assert operand.data_ptr() == stored.data_ptr()
    assert stored_forms(words, codes, 7) == (words, codes)
    v3_weight, v3_scale = stored_forms(plain, e4m3.view(torch.float8_e4m3fn), 3)
    assert v3_weight is plain and v3_scale.data_ptr() == e4m3.data_ptr()
    with pytest.raises(ValueError, match="stored_forms: variant must be 3 or 7, got 5"):
        stored_forms(plain, e4m3.view(torch.float8_e4m3fn), 5)
