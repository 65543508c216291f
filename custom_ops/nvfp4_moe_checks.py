"""The argument checks of `dlmc::nvfp4_moe` (`nvfp4_moe.nvfp4_moe`): every tensor's shape,
dtype, stored form and layout, with an error that names the tensor and what was expected."""

from __future__ import annotations

import torch

from dlmc.custom_ops.nvfp4_moe_tiles import ACTIVATIONS
from dlmc.custom_ops.nvfp4_words import CHUNK_K, ROWS, can_pack

__all__ = ["check_activation", "check_arguments", "check_shared_expert"]


def check_activation(activation: str, has_shared: bool) -> None:
    """`activation` is one of `ACTIVATIONS`; a shared expert (SwiGLU kernels) needs "silu"."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"nvfp4_moe: activation={activation!r}, expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    if has_shared and activation != "silu":
        raise ValueError(f"nvfp4_moe: the shared expert (shared_gate, shared_up, shared_down) "
                         f"is a SwiGLU MLP; activation={activation!r} takes none")


def check_arguments(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    weights: dict[str, torch.Tensor]) -> None:
    """x, the routing and the experts' tensors (`weights`, by argument name) have the shapes,
    dtypes and layouts `nvfp4_moe` takes; else a ValueError naming the tensor."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"nvfp4_moe: x must be bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"nvfp4_moe: topk_ids must be int32/int64 [T={T}, K], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"nvfp4_moe: topk_weights must be fp32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    E, I = weights["gate_weight"].shape[:2]
    expected = {
        "gate_weight": ((E, I, H // 2), torch.uint8), "up_weight": ((E, I, H // 2), torch.uint8),
        "down_weight": ((E, H, I // 2), torch.uint8),
        "gate_weight_scale": ((E, I, H // 16), torch.float8_e4m3fn),
        "up_weight_scale": ((E, I, H // 16), torch.float8_e4m3fn),
        "down_weight_scale": ((E, H, I // 16), torch.float8_e4m3fn),
        "gate_weight_scale_2": ((E,), torch.float32), "up_weight_scale_2": ((E,), torch.float32),
        "down_weight_scale_2": ((E,), torch.float32),
        "gate_input_scale": ((E,), torch.float32), "up_input_scale": ((E,), torch.float32),
        "down_input_scale": ((E,), torch.float32),
    }
    if H % 16 or I % 16:
        raise ValueError(f"nvfp4_moe: H={H} and I={I} must be multiples of 16")
    for name, tensor in weights.items():
        shape, dtype = expected[name]
        # Kernel v7's stored forms (`nvfp4_words.stored_forms`): weights as tiled words
        # (int32, a quarter wide), block scales as tiled int8 codes.
        if dtype == torch.float8_e4m3fn and tensor.dtype == torch.int8:
            dtype = torch.int8
        if dtype == torch.uint8 and tensor.dtype == torch.int32:
            shape, dtype = (*shape[:-1], shape[-1] // 4), torch.int32
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"nvfp4_moe: {name} must be {dtype} {shape}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        if tensor.dtype in (torch.int32, torch.int8):
            n, k = tensor.shape[1], (H if name.startswith(("gate", "up")) else I)
            if not can_pack(n, k):
                raise ValueError(f"nvfp4_moe: {name} is in the tiled layout of nvfp4_words, "
                                 f"which needs N % {ROWS} == 0 and K % {CHUNK_K} == 0 "
                                 f"(N={n}, K={k})")
        if not tensor.is_contiguous():
            raise ValueError(f"nvfp4_moe: {name} must be contiguous")


def check_shared_expert(gate_weight: torch.Tensor, H: int, gate: torch.Tensor | None,
                        up: torch.Tensor | None,
                        down: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The shared expert's weights (all three, bf16 `[I, H]`, `[I, H]`, `[H, I]`) or three Nones."""
    given = [t is not None for t in (gate, up, down)]
    if not any(given):
        return [None, None, None]
    I = gate_weight.shape[1]
    for name, tensor, shape in (("shared_gate", gate, (I, H)), ("shared_up", up, (I, H)),
                                ("shared_down", down, (H, I))):
        if tensor is None:
            raise ValueError("nvfp4_moe: the shared expert needs shared_gate, shared_up and "
                             f"shared_down; {name} is missing")
        if tuple(tensor.shape) != shape or tensor.dtype != torch.bfloat16:
            raise ValueError(f"nvfp4_moe: {name} must be bf16 {shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"nvfp4_moe: {name} must be contiguous")
    return [gate, up, down]
