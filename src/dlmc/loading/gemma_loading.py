"""A `diffusion_gemma` checkpoint's text weights -> `DiffusionGemmaForBlockDiffusion`.

Every text weight is stored once, under `model.decoder.*`, with the model's own names; the
lm_head is the token embedding (tied), and the encoder pass runs the same tensors. The vision
tower (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) and the encoder's
duplicate `layer_scalar` buffers (`model.encoder.language_model.layers.L.layer_scalar`) are
skipped by name from the safetensors headers: their data is never read. So are, in an NVFP4
export, the BF16 copies of the experts (`dlmc.loading.gemma_nvfp4`).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from dlmc.errors import ConfigError
from dlmc.loading import gemma_nvfp4 as nv
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.weights import FLOAT_DTYPES, assign_tensor, fetch, model_tensors, progress_bar
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.quant.modelopt_config import QuantConfig

log = logging.getLogger(__name__)

# Checkpoint tensors the text model does not use; matched on names, never read.
SKIPPED_RE = re.compile(
    r"^model\.encoder\.(?:vision_tower|embed_vision)\."
    r"|^model\.encoder\.language_model\.layers\.\d+\.layer_scalar$"
)
# FP8 KV-cache scales, read by `dlmc.kv.scales`.
KV_SCALE_RE = re.compile(r"\.self_attn\.(?:[\w.]*\.)?(?:[kv]_scale|output_scale)$")


def is_skipped(name: str) -> bool:
    """True for the vision tower's tensors and the encoder's duplicate `layer_scalar`s."""
    return SKIPPED_RE.search(name) is not None


def build_diffusion_gemma(
    directory: Path, config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype,
    precision: str, quant: QuantConfig | None, show_progress: bool = False,
) -> tuple[DiffusionGemmaForBlockDiffusion, SafetensorsIndex, str]:
    """Build the model on the meta device and fill it from `directory`'s safetensors.

    With a ModelOpt NVFP4 `quant` config the routed experts come from their NVFP4 tensors
    (`dlmc.loading.gemma_nvfp4`; the BF16 copies are never read) and run packed for
    precision "nvfp4" (also "auto" on a GPU), else dequantized at load into `GemmaExperts`.
    Returns the model, the index and what the experts run in ("bf16" or "nvfp4").
    """
    if quant is None and precision == "nvfp4":
        raise ConfigError(
            f"precision 'nvfp4': {directory} is a BF16 checkpoint (no hf_quant_config.json); "
            "use precision 'bf16' or 'auto'"
        )
    index = SafetensorsIndex(directory)
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
    used: set[str] = set()
    effective = "bf16"
    if quant is not None:
        on_gpu = device.type == "cuda"
        plan = nv.plan_experts(index, config, quant, ignore=is_skipped)
        nv.use_nvfp4_experts(model, on_gpu)
        used |= nv.load_experts(model, index, plan, device, show_progress)
        effective = "nvfp4" if precision == "nvfp4" or (precision == "auto" and on_gpu) else (
            "bf16")
    used |= load_gemma_weights(model, index, device, dtype, show_progress)
    if quant is not None and effective == "bf16":
        nv.dequantize_experts(model, dtype)
    elif quant is not None:
        nv.prepare_experts_for_kernel(model)
    _report_unused(directory, index, used, quantized=quant is not None)
    model.eval()
    return model, index, effective


def _report_unused(directory: Path, index: SafetensorsIndex, used: set[str],
                   quantized: bool) -> None:
    copies = {n for n in index.tensors if quantized and nv.is_bf16_expert_copy(n)}
    if copies:
        size = sum(math.prod(index.tensors[n].shape) * 2 for n in copies)
        log.info("%s: %d BF16 expert copies (%.1f GB) skipped unread: the experts load from "
                 "their NVFP4 tensors", directory, len(copies), size / 1e9)
    unused = [n for n in index.tensors if n not in used and not is_skipped(n)
              and not KV_SCALE_RE.search(n) and n not in copies]
    if unused:
        log.warning("%s: %d checkpoint tensor(s) not used by the model, e.g. %s",
                    directory, len(unused), ", ".join(unused[:3]))


def load_gemma_weights(
    model: DiffusionGemmaForBlockDiffusion, index: SafetensorsIndex, device: torch.device,
    dtype: torch.dtype, show_progress: bool = False,
) -> set[str]:
    """Fill every parameter and buffer of `model` still on the meta device with the checkpoint
    tensor of the same name, in `dtype` (buffers too: `layer_scalar` scales the residual stream
    in the activation dtype, as transformers keeps it). Returns the names read."""
    used: set[str] = set()
    targets = [(n, t) for n, t in model_tensors(model) if t.is_meta]  # not yet loaded
    with progress_bar(show_progress, len(targets)) as bar:
        task = bar.add_task("loading weights", total=len(targets)) if bar else None
        for name, meta in targets:
            tensor = fetch(index, name, tuple(meta.shape), FLOAT_DTYPES)
            assign_tensor(model, name, tensor.to(device, dtype))
            used.add(name)
            if bar:
                bar.advance(task)
    return used

