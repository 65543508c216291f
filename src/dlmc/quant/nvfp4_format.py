"""NVFP4 numerics (ModelOpt format): E2M1 codes, packing, exact dequantization, quantization.

A quantized linear `W [out, in]` is stored as
- `weight` uint8 `[out, in/2]`: two E2M1 codes per byte, element `2j` in the low nibble;
- `weight_scale` float8_e4m3fn `[out, in/16]`: one scale per 16-element block along `in`;
- `weight_scale_2` float32 scalar: the global scale.

`w[r, k] = e2m1(code[r, k]) * float(weight_scale[r, k // 16]) * weight_scale_2` (see
docs/nvfp4.md §2). Quantization follows ModelOpt's max calibration with round-half-to-even.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# Code c = (sign << 3) | m; magnitudes by m. Code 8 is negative zero.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
# Decision points between consecutive magnitudes; ties at the odd-indexed ones round up (to even m).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUND_UP = (0.75, 1.75, 3.5)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values indexed by code, fp32 `[16]` (code 8 is -0.0)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes uint8 `[..., n]` (0..15, n even) into uint8 `[..., n/2]`, low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension must be even, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 `[..., n]` into codes uint8 `[..., 2n]` (element 2j from the low nibble)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1: expected uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (uint8, 0..15) to fp32 values of the same shape (code 8 -> -0.0)."""
    return e2m1_table(codes.device)[codes.long()]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8, same shape): nearest, ties to even, saturating at 6.

    As in ModelOpt, the sign bit is `x < 0`, so small negatives that round to zero give code 8
    (negative zero) while an input of -0.0 gives code 0.
    """
    x = x.float()
    magnitude = x.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    index = torch.searchsorted(bounds, magnitude.contiguous(), right=False)  # ties round down
    tie_up = torch.zeros_like(magnitude, dtype=torch.bool)
    for tie in _TIES_ROUND_UP:
        tie_up |= magnitude == tie
    index = index + tie_up.long()
    sign = (x < 0).long() << 3
    return (index | sign).to(torch.uint8)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Cast fp32 to float8_e4m3fn after clamping to +-448 (a plain cast does not saturate)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _check_packed(packed: torch.Tensor, block_scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed weight: expected uint8, got {packed.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"block scale: expected float8_e4m3fn, got {block_scale.dtype}")
    expected = (*packed.shape[:-1], packed.shape[-1] * 2 // GROUP_SIZE)
    if packed.shape[-1] % (GROUP_SIZE // 2) or tuple(block_scale.shape) != expected:
        raise ValueError(
            f"block scale: expected shape {expected} for packed weight {tuple(packed.shape)}, "
            f"got {tuple(block_scale.shape)}"
        )


def dequantize_blocks(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """`e2m1(code) * float(block_scale)` without the global scale: fp32 `[..., out, in]`.

    Every value has at most 6 significant bits and lies in [2^-10, 2688], so it is exact in fp32
    and in bf16. packed: uint8 `[..., out, in/2]`; block_scale: float8_e4m3fn `[..., out, in/16]`.
    """
    _check_packed(packed, block_scale)
    values = e2m1_to_float(unpack_e2m1(packed))  # [..., out, in]
    scales = block_scale.float().repeat_interleave(GROUP_SIZE, dim=-1)  # [..., out, in]
    return values * scales


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize one NVFP4 linear to `dtype` `[out, in]` (also works with leading dims).

    packed: uint8 `[..., out, in/2]`; block_scale: float8_e4m3fn `[..., out, in/16]`;
    global_scale: fp32 scalar, `[1]`, or `[...]` matching the leading dims (one per matrix).
    The product is formed exactly in fp32 and rounded once to `dtype`.
    """
    blocks = dequantize_blocks(packed, block_scale)  # [..., out, in] fp32, exact
    scale = torch.as_tensor(global_scale, dtype=torch.float32, device=blocks.device)
    scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(*scale.shape, 1, 1)
    return (blocks * scale).to(dtype)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `weight_scale_2 = amax / (6 * 448)` as fp32 (1.0 for an all-zero tensor)."""
    amax = amax.float()
    scale = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_nvfp4(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize `weight [out, in]` with ModelOpt's max calibration.

    Returns `(packed uint8 [out, in/2], block_scale float8_e4m3fn [out, in/16], global_scale fp32
    [])`. `global_scale` defaults to `amax(|W|) / (6 * 448)`. Block scale
    `e4m3(clamp(blk_amax / (6 * s2), 2^-9, 448))` (1.0 for all-zero blocks); codes
    `rne_e2m1(w / (float(sb) * s2))`, packed low-nibble-first.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"quantize_nvfp4: expected a 2-D weight with in % {GROUP_SIZE} == 0, "
            f"got shape {tuple(weight.shape)}"
        )
    w = weight.float()
    out_features, in_features = w.shape
    if global_scale is None:
        global_scale = global_scale_from_amax(w.abs().amax())
    s2 = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(())
    blocks = w.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    block_amax = blocks.abs().amax(dim=-1)  # [out, in/16]
    raw = block_amax / (E2M1_MAX * s2)
    raw = torch.where(raw == 0, torch.ones_like(raw), raw)
    block_scale = e4m3(raw.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))  # [out, in/16]
    denominator = block_scale.float() * s2  # [out, in/16]
    scaled = blocks / denominator[..., None]  # [out, in/16, 16]
    codes = round_to_e2m1(scaled.reshape(out_features, in_features))
    return pack_e2m1(codes), block_scale, s2.clone()


def fake_quantize_activation(
    x: torch.Tensor, input_scale: torch.Tensor
) -> torch.Tensor:
    """W4A4 activation emulation (docs/nvfp4.md §2.4) WITHOUT the final division by `g`.

    x: `[R, K]` (K % 16 == 0); input_scale: fp32, broadcastable to `[R, 1]` (one per row or one
    scalar). With `g = 1 / input_scale`, per 16-block: `sx = e4m3(g * blk_amax / 6)`,
    `xq = rne_e2m1(clamp(x * (1 / (sx / g)), -6, 6))` (0 where `sx == 0`). Returns `xq * sx` as bf16
    `[R, K]` (exact); the true activation is this times `input_scale`, which the caller applies
    in fp32 after the matmul, as native W4A4 kernels do.
    """
    rows, cols = x.shape
    g = _reciprocal(input_scale.float().reshape(-1, 1))  # [R or 1, 1]
    blocks = x.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)  # [R, K/16]
    sx = e4m3(g * (amax * (1.0 / E2M1_MAX))).float()  # [R, K/16]
    # vLLM's ref_nvfp4_quant order: x * 1/(sx * 1/g), with 1/0 := 0.
    output_scale = _reciprocal(sx * _reciprocal(g))  # [R, K/16]
    scaled = (blocks * output_scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    xq = e2m1_to_float(round_to_e2m1(scaled))  # [R, K/16, 16]
    return (xq * sx[..., None]).reshape(rows, cols).to(torch.bfloat16)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """`1 / x` with `1 / 0 := 0` (as in vLLM's emulation)."""
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)
