"""Checkpoint directory -> (config, model on the target device), plus precision handling.

`load_model` dispatches on config.json's `model_type`: `llada2_moe` (LLaDA2.x MoE, BF16 or
NVFP4) or `diffusion_gemma` (DiffusionGemma, BF16 or NVFP4; `dlmc.loading.gemma_loading`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import CheckpointError, ConfigError
from dlmc.kv.scales import KVScales, load_kv_scales
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.weights import load_weights
from dlmc.models.config import LLaDA2Config, read_json_object
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.models.llada2 import LLaDA2ForDiffusion
from dlmc.models.nvfp4_experts import apply_kernel_config

PRECISIONS = ("auto", "bf16", "nvfp4")
MODEL_TYPES = ("llada2_moe", "diffusion_gemma")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class LoadedModel:
    config: LLaDA2Config | DiffusionGemmaConfig
    model: LLaDA2ForDiffusion | DiffusionGemmaForBlockDiffusion
    index: SafetensorsIndex
    precision: str  # what the experts run in: "bf16" (dense experts) or "nvfp4"
    quantized_checkpoint: bool
    kv_scales: KVScales  # per-layer FP8 KV scales (1.0 where the checkpoint has none)
    declares_fp8_kv: bool  # the export declares an FP8 KV cache

    @property
    def model_type(self) -> str:
        """config.json's `model_type`: "llada2_moe" or "diffusion_gemma"."""
        return "diffusion_gemma" if isinstance(self.config, DiffusionGemmaConfig) else (
            "llada2_moe")


def available_devices() -> str:
    """The devices this torch can run dlmc on, for error messages: `cpu`, `cuda:0`, ..."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])


def parse_device(device: str | torch.device | None) -> torch.device:
    """None -> CUDA if available, else the CPU; else `cpu`, `cuda` or `cuda:N` that this torch
    can use (a ConfigError naming the option and the devices available otherwise)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r}: expected cpu, cuda or cuda:N (available "
                          f"here: {available_devices()})")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "CUDA finds no GPU")
            raise ConfigError(f"device {str(device)!r}: {why} (available here: "
                              f"{available_devices()})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(device)!r}: no such GPU (available here: "
                              f"{available_devices()})")
    return parsed


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device,
                kv_cache_dtype: str = "auto") -> torch.dtype:
    """None -> bf16 on CUDA or with an FP8 KV cache (LLaDA2's needs bf16 activations), else fp32;
    else a torch dtype or one of DTYPES' names."""
    if dtype is None:
        fp8 = kv_cache_dtype == "fp8"
        return torch.bfloat16 if device.type == "cuda" or fp8 else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype {dtype!r}: expected one of bf16, fp16, fp32")


def load_model(
    directory: Path,
    device: torch.device,
    dtype: torch.dtype,
    precision: str = "auto",
    show_progress: bool = False,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> LoadedModel:
    """Build the model on the meta device and stream the checkpoint's tensors onto `device`;
    its ops take `kernels`' choices."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    raw = read_config(directory / "config.json")
    from dlmc.quant.modelopt_config import load_quant_config

    quant = load_quant_config(directory)
    if raw.get("model_type") == "diffusion_gemma":
        from dlmc.loading.gemma_loading import build_diffusion_gemma

        gemma = DiffusionGemmaConfig.from_dict(raw, source=str(directory / "config.json"))
        model, index, effective = build_diffusion_gemma(directory, gemma, device, dtype,
                                                        precision, quant, show_progress)
        declares = quant is not None and quant.kv_cache_fp8
        weight_map = {name: info.file for name, info in index.tensors.items()}
        kv_scales = load_kv_scales(weight_map, gemma.num_hidden_layers, declares_fp8=declares)
        apply_kernel_config(model, kernels)
        return LoadedModel(gemma, model, index, effective, quant is not None, kv_scales,
                           declares)
    config = LLaDA2Config.from_dict(raw, source=str(directory / "config.json"))
    if quant is None and precision == "nvfp4":
        raise ConfigError(
            f"precision 'nvfp4': {directory} is a BF16 checkpoint (no hf_quant_config.json); "
            "use precision 'bf16' or 'auto'"
        )
    index = SafetensorsIndex(directory)
    with torch.device("meta"):
        model = LLaDA2ForDiffusion(config)
    effective = "bf16"
    declares_fp8_kv = quant is not None and quant.kv_cache_fp8
    weight_map = {name: info.file for name, info in index.tensors.items()}
    kv_scales = load_kv_scales(weight_map, config.num_hidden_layers, declares_fp8=declares_fp8_kv)
    if quant is not None:
        from dlmc.loading import nvfp4_loading as nv

        nv.validate_quantized_experts(index, config, quant)
        nv.use_nvfp4_experts(model, config, on_gpu=device.type == "cuda")
        effective = "nvfp4" if precision == "nvfp4" or (
            precision == "auto" and device.type == "cuda") else "bf16"
    load_weights(model, index, device, dtype, config.num_experts,
                 config.tie_word_embeddings, show_progress)
    if quant is not None and effective == "bf16":
        nv.dequantize_experts(model, config, dtype)
    elif quant is not None:
        nv.prepare_experts_for_kernel(model)
    apply_kernel_config(model, kernels)
    model.eval()
    return LoadedModel(config, model, index, effective, quant is not None, kv_scales,
                       declares_fp8_kv)


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict whose `model_type` is one dlmc supports."""
    raw = read_json_object(path)
    if raw.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unknown model_type {raw.get('model_type')!r}; dlmc supports "
            f"{', '.join(MODEL_TYPES)}"
        )
    return raw
