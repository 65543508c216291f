"""ModelOpt NVFP4 checkpoints: validate the quantized experts from the safetensors headers,
swap in NVFP4 experts before loading, and dequantize them for `precision="bf16"`.
(FP8 KV-cache scales: `dlmc.kv.scales`.)"""

from __future__ import annotations

import torch
from torch import nn

from dlmc.errors import CheckpointError
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.models.config import LLaDA2Config
from dlmc.models.moe import BF16Experts, MoEBlock
from dlmc.quant.modelopt_config import QuantConfig
from dlmc.quant.validate import SAFETENSORS_DTYPES, TensorMeta

PROJ_SHAPES = {"gate_proj": "IH", "up_proj": "IH", "down_proj": "HI"}


def _meta(index: SafetensorsIndex, name: str) -> TensorMeta:
    info = index.tensors[name]
    return TensorMeta(SAFETENSORS_DTYPES.get(info.dtype, torch.uint8), info.shape)


def validate_quantized_experts(index: SafetensorsIndex, config: LLaDA2Config,
                               quant: QuantConfig) -> None:
    """Every routed expert is NVFP4 with valid tensors; nothing else is quantized."""
    from dlmc.quant.validate import validate_nvfp4_linear

    sizes = {"I": config.moe_intermediate_size, "H": config.hidden_size}
    for name, info in index.tensors.items():
        if info.dtype == "U8" and name.endswith(".weight") and ".mlp.experts." not in name:
            raise CheckpointError(
                f"{info.file.name}: {name} is quantized, but dlmc runs NVFP4 only for routed "
                "experts (expected this module in exclude_modules)"
            )
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        for expert in range(config.num_experts):
            for proj, (out_dim, in_dim) in PROJ_SHAPES.items():
                module = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                if not quant.is_quantized(module):
                    raise CheckpointError(
                        f"{quant.source}: {module} is not quantized; dlmc expects every routed "
                        "expert in NVFP4"
                    )
                tensors = {s: _meta(index, f"{module}.{s}") for s in
                           ("weight", "weight_scale", "weight_scale_2", "input_scale")
                           if f"{module}.{s}" in index}
                validate_nvfp4_linear(module, tensors, sizes[out_dim], sizes[in_dim])


def use_nvfp4_experts(model: nn.Module, config: LLaDA2Config, on_gpu: bool) -> None:
    """Replace every MoE layer's experts with (meta-device) NVFP4 experts."""
    from dlmc.models.nvfp4_experts import NVFP4Experts

    for module in model.modules():
        if isinstance(module, MoEBlock):
            module.experts = NVFP4Experts(config.num_experts, config.hidden_size,
                                          config.moe_intermediate_size,
                                          use_reference=not on_gpu, device="meta")


def prepare_experts_for_kernel(model: nn.Module) -> None:
    """precision="nvfp4": the kernel's load-time form of the experts (v4/v6: pre-decoded bf16
    block scales, v5-v7: tiled weight words, v7 with scale codes, all exact; v1-v3 keep
    ModelOpt's), one projection at a time (`NVFP4Experts.prepare_for_kernel`)."""
    from dlmc.models.nvfp4_experts import NVFP4Experts

    for module in model.modules():
        if isinstance(module, NVFP4Experts):
            module.prepare_for_kernel()


@torch.no_grad()
def dequantize_experts(model: nn.Module, config: LLaDA2Config, dtype: torch.dtype) -> None:
    """precision="bf16": NVFP4 experts -> BF16 experts, dequantized exactly, one layer at a time."""
    from dlmc.models.nvfp4_experts import NVFP4Experts

    for module in model.modules():
        if isinstance(module, MoEBlock) and isinstance(module.experts, NVFP4Experts):
            weights = module.experts.dequantize_to_bf16()
            with torch.device("meta"):
                dense = BF16Experts(config.num_experts, config.hidden_size,
                                    config.moe_intermediate_size)
            for proj, value in weights.items():
                dense._parameters[f"{proj}_weight"] = nn.Parameter(value.to(dtype),
                                                                   requires_grad=False)
            module.experts = dense
