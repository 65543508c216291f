"""Validate the tensors of one NVFP4 linear (and FP8 KV scales) before loading them.

Works on `TensorMeta` (dtype + shape), which `safetensors_meta` reads from a file's header
without reading the data, or on tensors. Errors name the tensor and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dlmc.errors import CheckpointError
from dlmc.quant.nvfp4_format import GROUP_SIZE

# safetensors header dtype strings -> torch dtypes (the ones an NVFP4 export uses).
SAFETENSORS_DTYPES = {
    "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
SCALAR_SHAPES = ((), (1,))


@dataclass(frozen=True)
class TensorMeta:
    """dtype and shape of a tensor, without its data."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.dtype, tuple(tensor.shape))


def safetensors_meta(handle: Any, name: str) -> TensorMeta:
    """Meta of tensor `name` from a `safetensors.safe_open` handle (header only, no data read)."""
    tensor_slice = handle.get_slice(name)
    dtype_name = tensor_slice.get_dtype()
    if dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{name}: unsupported safetensors dtype {dtype_name}")
    return TensorMeta(SAFETENSORS_DTYPES[dtype_name], tuple(tensor_slice.get_shape()))


def _meta(value: TensorMeta | torch.Tensor) -> TensorMeta:
    return value if isinstance(value, TensorMeta) else tensor_meta(value)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _expect(name: str, meta: TensorMeta, dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...],
            what: str) -> None:
    if meta.dtype != dtype:
        raise CheckpointError(f"{name}: expected {what} of dtype {dtype}, got {meta.dtype}")
    if meta.shape not in shapes:
        raise CheckpointError(
            f"{name}: expected {what} of shape {' or '.join(map(str, shapes))}, got {meta.shape}"
        )


def validate_nvfp4_linear(
    module: str,
    tensors: Mapping[str, TensorMeta | torch.Tensor],
    out_features: int,
    in_features: int,
    *,
    require_input_scale: bool = False,
) -> None:
    """Check `{suffix: tensor or meta}` of module `module` (`weight`, `weight_scale`,
    `weight_scale_2`, optional `input_scale`) against the unquantized shape `[out, in]`.

    Raises `CheckpointError` naming the tensor for: missing tensors, an unquantized (bf16) weight,
    wrong dtypes or shapes, padded or 128x4-swizzled scale layouts, `in % 16 != 0`, and (when
    tensors are given) non-finite or non-positive scalar scales.
    """
    if in_features % GROUP_SIZE:
        raise CheckpointError(
            f"{module}.weight: in_features={in_features} is not a multiple of {GROUP_SIZE}"
        )
    required = ("weight", "weight_scale", "weight_scale_2") + (
        ("input_scale",) if require_input_scale else ())
    for suffix in required:
        if suffix not in tensors:
            raise CheckpointError(
                f"{module}.{suffix}: missing (the quantization config marks {module} as NVFP4)"
            )
    weight = _meta(tensors["weight"])
    if weight.dtype != torch.uint8 and weight.shape == (out_features, in_features):
        raise CheckpointError(
            f"{module}.weight: is an unquantized {weight.dtype} tensor, but the quantization "
            "config marks the module as NVFP4 (expected packed uint8)"
        )
    _expect(f"{module}.weight", weight, torch.uint8, ((out_features, in_features // 2),),
            "packed E2M1 codes")
    scale = _meta(tensors["weight_scale"])
    blocks = in_features // GROUP_SIZE
    swizzled = (_round_up(out_features, 128), _round_up(blocks, 4))
    if scale.shape != (out_features, blocks) and (
        scale.shape == swizzled or (len(scale.shape) == 1 and scale.shape[0] == math.prod(swizzled))
    ):
        raise CheckpointError(
            f"{module}.weight_scale: shape {scale.shape} is a padded/128x4-swizzled scale layout "
            f"(for TensorRT-LLM/CUTLASS); dlmc needs plain row-major [{out_features}, {blocks}]. "
            "Re-export without scale swizzling."
        )
    _expect(f"{module}.weight_scale", scale, torch.float8_e4m3fn, ((out_features, blocks),),
            "per-16 FP8 block scales")
    for suffix in ("weight_scale_2", "input_scale"):
        if suffix in tensors:
            value = tensors[suffix]
            _expect(f"{module}.{suffix}", _meta(value), torch.float32, SCALAR_SHAPES,
                    "fp32 scalar")
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                validate_positive_scalar(f"{module}.{suffix}", value)


def validate_positive_scalar(name: str, value: torch.Tensor) -> None:
    """A scale must be finite and > 0."""
    number = float(value.reshape(()))
    if not math.isfinite(number) or number <= 0:
        raise CheckpointError(f"{name}: expected a finite positive scale, got {number}")


def validate_kv_scale(name: str, value: TensorMeta | torch.Tensor) -> None:
    """`...k_scale`/`...v_scale`: fp32 scalar (positive and finite when data is given)."""
    _expect(name, _meta(value), torch.float32, SCALAR_SHAPES, "FP8 KV-cache scale (fp32 scalar)")
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        validate_positive_scalar(name, value)
