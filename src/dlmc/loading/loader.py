"""Checkpoint directory -> (config, model on the target device), plus precision handling."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dlmc.errors import CheckpointError, ConfigError
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.weights import load_weights
from dlmc.models.config import LLaDA2Config
from dlmc.models.llada2 import LLaDA2ForDiffusion

PRECISIONS = ("auto", "bf16", "nvfp4")
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
    config: LLaDA2Config
    model: LLaDA2ForDiffusion
    index: SafetensorsIndex
    precision: str  # what the experts run in: "bf16" (dense experts) or "nvfp4"
    quantized_checkpoint: bool


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> bf16 on CUDA, fp32 on CPU; else a torch dtype or one of DTYPES' names."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype {dtype!r}: expected one of bf16, fp16, fp32")


def is_quantized_checkpoint(directory: Path) -> bool:
    if (directory / "hf_quant_config.json").is_file():
        return True
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and bool(raw.get("quantization_config"))


def load_model(
    directory: Path,
    device: torch.device,
    dtype: torch.dtype,
    precision: str = "auto",
    show_progress: bool = False,
) -> LoadedModel:
    """Build the model on the meta device and stream the checkpoint's tensors onto `device`."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    config = LLaDA2Config.from_file(directory / "config.json")
    quantized = is_quantized_checkpoint(directory)
    if quantized:
        raise CheckpointError(
            f"{directory}: NVFP4 (ModelOpt) checkpoints are not supported by this build of dlmc"
        )
    if precision == "nvfp4":
        raise ConfigError(
            f"precision 'nvfp4': {directory} is a BF16 checkpoint (no hf_quant_config.json); "
            "use precision 'bf16' or 'auto'"
        )
    index = SafetensorsIndex(directory)
    with torch.device("meta"):
        model = LLaDA2ForDiffusion(config)
    load_weights(
        model, index, device, dtype, config.num_experts, config.tie_word_embeddings, show_progress
    )
    model.eval()
    return LoadedModel(config, model, index, "bf16", quantized)
