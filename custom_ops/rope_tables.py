"""`dlmc::rope_tables`: a round's rotary cos/sin tables in one Triton launch.

The tables are `cos(angles)`, `sin(angles)` `[T, R]` with fp32 angles `position * inv_freq[i]`
(`cat(angles, angles)` along the last dim), rounded to bf16. Written as torch ops inside the
compiled round, Inductor recomputes them next to their consumers (ten launches per round for
the twenty layers' `qk_norm_rope` calls); computed inside `qk_norm_rope`'s programs, every
head's program would make them again. Here one program per token writes its rows once; the
layers read them. cos/sin are libdevice's (CUDA's `cosf`/`sinf`, what eager PyTorch runs), so
the tables equal the eager ones bit for bit. The maths is `rope_tables_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["cos_sin_tables", "rope_inv_freq", "rope_tables", "rope_tables_reference"]


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """fp32 `[rotary_dim / 2]`: `inv_freq[i] = theta^(-2i / rotary_dim)`."""
    exponent = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32)
    return 1.0 / (theta ** (exponent / rotary_dim))


def rope_tables_reference(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[T, 2 * len(inv_freq)]` in `dtype` for absolute `positions [T]`: fp32
    angles `position * inv_freq`, the table `cat(angles, angles)`, fp32 cos/sin."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    table = torch.cat([angles, angles], dim=-1)  # [T, R]
    return table.cos().to(dtype), table.sin().to(dtype)


@triton.jit
def rope_tables_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, INTERPRETED: tl.constexpr):
    """Row `token` of both tables: columns i and HALF + i hold frequency i's angle."""
    token = tl.program_id(0)
    i = tl.arange(0, HALF_PAD)
    live = i < HALF
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=live,
                                                             other=0.0)  # [HALF_PAD] fp32
    c = round_bf16(tl.cos(angle), INTERPRETED)
    s = round_bf16(tl.sin(angle), INTERPRETED)
    row = token.to(tl.int64) * (2 * HALF)
    for offset in tl.static_range(0, 2 * HALF, HALF):
        tl.store(cos_ptr + row + offset + i, c, mask=live)
        tl.store(sin_ptr + row + offset + i, s, mask=live)


def _rope_tables_impl(positions: torch.Tensor, inv_freq: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = positions.new_empty((tokens, 2 * half), dtype=torch.bfloat16)
    sin = torch.empty_like(cos)
    if tokens and half:
        launcher(rope_tables_kernel)[(tokens,)](
            positions, inv_freq, cos, sin, HALF=half, HALF_PAD=triton.next_power_of_2(half),
            INTERPRETED=_INTERPRETED, num_warps=1)
    return cos, sin


def _rope_tables_fake(positions: torch.Tensor, inv_freq: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], 2 * inv_freq.shape[0])
    return (positions.new_empty(shape, dtype=torch.bfloat16),
            positions.new_empty(shape, dtype=torch.bfloat16))


_rope_tables_op = traced_triton_op("dlmc::rope_tables", _rope_tables_impl, _rope_tables_fake)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 cos/sin tables `[T, R]` (Triton, `dlmc::rope_tables`).

    positions int `[T]` (absolute); inv_freq fp32 `[R/2]` (`rope_inv_freq`), same device.
    Returns `(cos, sin)` bf16 `[T, R]`, equal to `rope_tables_reference(..., torch.bfloat16)`
    when the device's cos/sin are eager PyTorch's (CUDA). Runs on CUDA and under
    `TRITON_INTERPRET=1`; elsewhere the reference. No host sync.
    """
    if positions.dim() != 1 or positions.dtype.is_floating_point:
        raise ValueError(f"rope_tables: positions must be integer [T], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"rope_tables: inv_freq must be fp32 [R/2], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    if positions.device != inv_freq.device:
        raise ValueError(f"rope_tables: positions and inv_freq must be on one device, got "
                         f"{positions.device} and {inv_freq.device}")
    if not (positions.is_cuda or _INTERPRETED):
        return rope_tables_reference(positions, inv_freq, torch.bfloat16)
    return _rope_tables_op(positions.contiguous(), inv_freq.contiguous())


def cos_sin_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The models' tables in `dtype`: bf16 tables of CUDA positions from one
    `dlmc::rope_tables` launch (the same bits; as torch ops inside a compiled round, Inductor
    would recompute them inside every layer's kernels), others from the torch ops of
    `rope_tables_reference`."""
    if positions.is_cuda and dtype == torch.bfloat16:
        return rope_tables(positions, inv_freq)
    return rope_tables_reference(positions, inv_freq, dtype)
