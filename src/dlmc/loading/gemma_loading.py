"""A `diffusion_gemma` checkpoint's text weights -> `DiffusionGemmaForBlockDiffusion`.

Every text weight is stored once, under `model.decoder.*`, with the model's own names; the
lm_head is the token embedding (tied), and the encoder pass runs the same tensors. The vision
tower (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) and the encoder's
duplicate `layer_scalar` buffers (`model.encoder.language_model.layers.L.layer_scalar`) are
skipped by name from the safetensors headers: their data is never read.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from dlmc.errors import ConfigError
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.weights import FLOAT_DTYPES, assign_tensor, fetch, model_tensors, progress_bar
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig

log = logging.getLogger(__name__)

# Checkpoint tensors the text model does not use; matched on names, never read.
SKIPPED_RE = re.compile(
    r"^model\.encoder\.(?:vision_tower|embed_vision)\."
    r"|^model\.encoder\.language_model\.layers\.\d+\.layer_scalar$"
)


def is_skipped(name: str) -> bool:
    """True for the vision tower's tensors and the encoder's duplicate `layer_scalar`s."""
    return SKIPPED_RE.search(name) is not None


def build_diffusion_gemma(
    directory: Path, config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype,
    precision: str, quantized: bool, show_progress: bool = False,
) -> tuple[DiffusionGemmaForBlockDiffusion, SafetensorsIndex]:
    """Build the model on the meta device and fill it from `directory`'s safetensors.

    BF16 checkpoints only: an NVFP4 export (`quantized`) or `precision="nvfp4"` is an error.
    """
    if quantized:
        raise ConfigError(
            f"{directory}: NVFP4 DiffusionGemma checkpoints are not supported yet (the "
            "checkpoint has an NVFP4 quantization config); use a BF16 checkpoint"
        )
    if precision == "nvfp4":
        raise ConfigError(
            f"precision 'nvfp4': {directory} is a BF16 checkpoint (no hf_quant_config.json), "
            "and NVFP4 DiffusionGemma is not supported yet; use precision 'bf16' or 'auto'"
        )
    index = SafetensorsIndex(directory)
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
    used = load_gemma_weights(model, index, device, dtype, show_progress)
    unused = [n for n in index.tensors if n not in used and not is_skipped(n)]
    if unused:
        log.warning("%s: %d checkpoint tensor(s) not used by the model, e.g. %s",
                    directory, len(unused), ", ".join(unused[:3]))
    model.eval()
    return model, index


def load_gemma_weights(
    model: DiffusionGemmaForBlockDiffusion, index: SafetensorsIndex, device: torch.device,
    dtype: torch.dtype, show_progress: bool = False,
) -> set[str]:
    """Fill every meta parameter and buffer of `model` with the checkpoint tensor of the same
    name, in `dtype` (buffers too: `layer_scalar` scales the residual stream in the activation
    dtype, as transformers keeps it). Returns the names read."""
    used: set[str] = set()
    targets = list(model_tensors(model))
    with progress_bar(show_progress, len(targets)) as bar:
        task = bar.add_task("loading weights", total=len(targets)) if bar else None
        for name, meta in targets:
            tensor = fetch(index, name, tuple(meta.shape), FLOAT_DTYPES)
            assign_tensor(model, name, tensor.to(device, dtype))
            used.add(name)
            if bar:
                bar.advance(task)
    return used

