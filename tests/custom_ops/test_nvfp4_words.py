"""`nvfp4_words`: kernel v5's weight layout. Exact both ways, every code at every position, and
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
    STORAGE_MAP,
    decode_words_emulated,
    pack_weight_words,
    unpack_weight_words,
    weights_for_kernel,
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


def test_pack_unpack_round_trip_is_exact() -> None:
    everything = every_code_everywhere()
    assert torch.equal(unpack_weight_words(pack_weight_words(everything)), everything)
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=gen)
    words = pack_weight_words(random)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 16)
    assert torch.equal(unpack_weight_words(words), random)
    assert torch.equal(weights_for_kernel(random, words=True), words.view(torch.uint8))
    assert torch.equal(weights_for_kernel(words, words=False), random)
    assert weights_for_kernel(random, words=False) is random


def test_words_decode_equals_v3_decode_bit_for_bit() -> None:
    everything = every_code_everywhere()  # [2048, 4]
    gen = torch.Generator().manual_seed(1)
    scale_bytes = torch.randint(0, 256, (everything.shape[0],), dtype=torch.uint8, generator=gen)
    scale_bytes[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every E4M3 code
    pairs = scale_pairs_emulated(scale_bytes)
    v3 = decode_pairs_emulated(words_of_bytes(everything), pairs)
    v5 = decode_words_emulated(pack_weight_words(everything).reshape(-1).long(), pairs)
    assert torch.equal(v5.view(torch.int16), v3.view(torch.int16))
    assert (v3.float().abs() > 0).any()  # not all zeros (NaN scale codes give NaN rows)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="pack_weight_words: expected uint8"):
        pack_weight_words(torch.zeros(2, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="K/2 % 4 == 0"):
        pack_weight_words(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack_weight_words: expected int32"):
        unpack_weight_words(torch.zeros(2, 2, dtype=torch.int64))
