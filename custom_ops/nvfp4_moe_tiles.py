"""`NVFP4Tiles`: the tiles of `dlmc::nvfp4_moe`'s Triton kernels, and the op's own choice.

The two Triton kernels (`_nvfp4_moe_kernels`) run one program per (routing block, N-tile): the
program streams its expert's weight tile over the whole K and decodes it in registers, whatever
the block's slot count. So the slots per routing block (`block_m`) decide how often an expert's
weights are read and decoded: once per block. `default_tiles` is the op's choice by shape
(docs/nvfp4.md §3.4): a caller or a benchmark may pass its own `NVFP4Tiles` instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dlmc.custom_ops.moe_align import route_block_m

__all__ = ["ACTIVATIONS", "NVFP4Tiles", "block_m_for_many_pairs", "default_tiles",
           "gluon_fits"]

# The gated activations of the experts: `down(act(gate(x)) * up(x))`. "silu": SwiGLU (LLaDA2);
# "gelu_tanh": GeGLU with PyTorch's tanh approximation (DiffusionGemma's `gelu_pytorch_tanh`).
ACTIVATIONS = ("silu", "gelu_tanh")
# Widest N-tile of each kernel by variant (v7's gate/up: one 128-row run of its layout).
_GATE_UP_BLOCK_N = {3: 64, 7: 128}
_DOWN_BLOCK_N = {3: 128, 7: 128}
_POWERS = {"block_m": (16, 32, 64, 128), "gate_up_block_n": (16, 32, 64, 128),
           "gate_up_block_k": (32, 64, 128), "down_block_n": (16, 32, 64, 128),
           "down_block_k": (32, 64, 128), "gate_up_warps": (2, 4, 8), "down_warps": (2, 4, 8),
           "num_stages": (1, 2, 3, 4, 5)}


@dataclass(frozen=True)
class NVFP4Tiles:
    """Tiles of the Triton kernels of `dlmc::nvfp4_moe` (passing them runs those kernels).

    Attributes:
        block_m: slots per routing block (`moe_align`): each block's programs read and decode
            their expert's weight tile once, for all its slots.
        gate_up_block_n, down_block_n: N-tile (columns of I, of H) per program.
        gate_up_block_k, down_block_k: K-step of the main loop (kernel v7: 128, its runs).
        gate_up_warps, down_warps: warps per program.
        num_stages: software-pipelining stages of both K loops (Triton's default is 3).
    """

    block_m: int
    gate_up_block_n: int
    gate_up_block_k: int
    down_block_n: int
    down_block_k: int
    gate_up_warps: int = 4
    down_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, allowed in _POWERS.items():
            value = getattr(self, name)
            if type(value) is not int or value not in allowed:
                raise ValueError(f"NVFP4Tiles.{name}={value!r}: expected one of {allowed}")

    def as_list(self) -> list[int]:
        """The fields in order (how the registered op takes them)."""
        return [getattr(self, name) for name in _FIELDS]

    @classmethod
    def from_list(cls, values: list[int]) -> NVFP4Tiles:
        """Inverse of `as_list`."""
        if len(values) != len(_FIELDS):
            raise ValueError(f"NVFP4Tiles: expected {len(_FIELDS)} values "
                             f"({', '.join(_FIELDS)}), got {list(values)}")
        return cls(**dict(zip(_FIELDS, (int(v) for v in values), strict=True)))

    @classmethod
    def parse(cls, text: str, base: NVFP4Tiles) -> NVFP4Tiles:
        """`base` with the fields `text` names changed: "block_m=32,down_block_k=64".
        (Plain Python over `_FIELDS`: it also runs inside a compiled model's forward.)"""
        names = set(_FIELDS)
        changes = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in names or not value.strip().isdigit():
                raise ValueError(f"NVFP4Tiles: {item!r} is not name=integer with a name among "
                                 f"{', '.join(sorted(names))}")
            changes[name.strip()] = int(value)
        return cls(**{name: changes.get(name, getattr(base, name)) for name in _FIELDS})

    def check_shape(self, variant: int) -> None:
        """Kernel v7's tiled layout is read in 128-wide K-steps (`nvfp4_tiles`)."""
        if variant == 7 and (self.gate_up_block_k, self.down_block_k) != (128, 128):
            raise ValueError(f"NVFP4Tiles: kernel v7 (H and I multiples of 128) reads K in "
                             f"steps of 128; got gate_up_block_k={self.gate_up_block_k}, "
                             f"down_block_k={self.down_block_k}")

    def describe(self) -> str:
        """`name=value` of every field (the text `parse` reads)."""
        return ",".join(f"{name}={getattr(self, name)}" for name in _FIELDS)


_FIELDS = tuple(f.name for f in dataclasses.fields(NVFP4Tiles))  # in order


def _block_n(dim: int, widest: int) -> int:
    """N-tile width: `widest`, narrower for small dims."""
    return next((b for b in (128, 64, 32) if b <= widest and dim >= b), 16)


def block_m_for_many_pairs(num_pairs: int, num_experts: int) -> int:
    """Slots per routing block that hold an expert's pairs in one block (16, 32 or 64).

    Routed uniformly, an expert's pair count has mean `m = P / E` and a standard deviation of
    at most `sqrt(m)` (binomial), so blocks of at least `m + 3 sqrt(m)` slots leave almost no
    expert a second block (which would read and decode its weights a second time). The
    smallest such power of two, 16 (the MMA minimum) to 64 (the kernels' registers at 4 warps).
    DiffusionGemma's canvas (256 tokens, top-8 of 128 experts: m = 16) takes 32. Integer
    arithmetic: `b >= m + 3 sqrt(m)` iff `b*E - P >= 0` and `(b*E - P)^2 >= 9*P*E`.
    """
    for block_m in (16, 32):
        spare = block_m * num_experts - num_pairs
        if spare >= 0 and spare * spare >= 9 * num_pairs * num_experts:
            return block_m
    return 64


def gluon_fits(tokens: int, top_k: int, num_experts: int,
               shared_in_routing: bool = False) -> bool:
    """Whether an expert's pairs fit one 16-slot routing block (`block_m_for_many_pairs`
    gives 16), where the op's default runs the Gluon kernels: they decode each weight tile
    once per 8-slot part, so with more pairs per expert (~7.3 and up: LLaDA2's prompt
    chunks, DiffusionGemma's canvas) the Triton kernels, one decode per block, run instead."""
    shared = int(shared_in_routing)
    return block_m_for_many_pairs(tokens * (top_k + shared), num_experts + shared) == 16


def default_tiles(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  variant: int, shared_in_routing: bool = False) -> NVFP4Tiles:
    """The op's tiles for a call (`shared_in_routing`: the shared expert's pairs join the
    routing, `moe_align.route_block_m`).

    Kernel v7's shapes (H, I multiples of 128: LLaDA2, DiffusionGemma widened to 768) take
    `route_block_m`'s blocks, 16 slots up to 16 pairs per expert, then 32 and 64: where the
    Gluon kernels do not run (`gluon_fits`), the Triton kernels at 16 slots measured faster
    than at 32 even where some experts take a second block (docs/nvfp4.md §3.4, §3.9).
    Kernel v3's (DiffusionGemma's I = 704: only the Triton kernels) take
    `block_m_for_many_pairs`. Both: N-tiles as wide as the variant's widest, K-steps of 128
    (32 for K < 128), 4 warps and 3 stages per program (Triton's defaults).
    """
    if variant == 7:
        block_m = route_block_m(tokens, top_k, num_experts, shared_in_routing)
    else:
        shared = int(shared_in_routing)
        block_m = block_m_for_many_pairs(tokens * (top_k + shared), num_experts + shared)
    return NVFP4Tiles(
        block_m=block_m, gate_up_block_n=_block_n(inter, _GATE_UP_BLOCK_N[variant]),
        gate_up_block_k=128 if hidden >= 128 else 32,
        down_block_n=_block_n(hidden, _DOWN_BLOCK_N[variant]),
        down_block_k=128 if inter >= 128 else 32)
