"""Write a ModelOpt-format NVFP4 export from a BF16 checkpoint directory.

Every routed-expert linear `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` is quantized
with ModelOpt's max calibration (`quantize_nvfp4`) into `weight` (uint8 `[out, in/2]`),
`weight_scale` (float8_e4m3fn `[out, in/16]`) and `weight_scale_2` (fp32 `[]`); with
`input_amax`, also `input_scale = input_amax / (6 * 448)` (fp32 `[]`, same for every expert, as
there is no calibration data). All other tensors are copied unchanged, shard by shard.

FP8 KV-cache scales, when given, are written as `model.layers.L.attention.k_scale` and
`model.layers.L.attention.v_scale` (fp32 `[]`; LLaDA2 has one fused `query_key_value`
projection, so the scales sit on the attention module) and `kv_cache_quant_algo` becomes "FP8".

Also written: `hf_quant_config.json`, config.json with a `quantization_config` block, the
safetensors index (if the source had one); tokenizer files, generation_config.json,
paper_decoding.json and other non-weight files are copied.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dlmc.errors import CheckpointError
from dlmc.quant.modelopt_config import HF_QUANT_CONFIG, NVFP4_GROUP_SIZE, module_of
from dlmc.quant.nvfp4_format import E2M1_MAX, E4M3_MAX, quantize_nvfp4

EXPERT_WEIGHT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj))\.weight$"
)
INDEX_FILE = "model.safetensors.index.json"
_NOT_COPIED = {"config.json", HF_QUANT_CONFIG, INDEX_FILE}
_PRODUCER = {"name": "dlmc", "version": "0.1.0"}
_FP4_SCHEME = {"num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE, "dynamic": False}


def kv_scale_names(layer: int) -> tuple[str, str]:
    """Tensor names of layer `layer`'s FP8 KV-cache scales in exports written here."""
    prefix = f"model.layers.{layer}.attention"
    return f"{prefix}.k_scale", f"{prefix}.v_scale"


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _exclude_globs(unquantized: set[str], quantized: set[str]) -> list[str]:
    """Layer/expert indices replaced by `*` where the glob matches no quantized module."""
    globs = set()
    for module in unquantized:
        glob = re.sub(r"\.(layers|experts)\.\d+\.", r".\1.*.", module)
        clashes = any(fnmatch.fnmatchcase(q, glob) for q in quantized)
        globs.add(module if clashes else glob)
    return sorted(globs)


def _quantize_shard(
    path: Path, input_scale: float | None, kv_scales: Mapping[int, tuple[float, float]],
    written_kv: set[int], quantized: set[str], unquantized: set[str],
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = handle.get_tensor(name)
            match = EXPERT_WEIGHT.match(name)
            if match is None:
                tensors[name] = tensor
                if name.endswith(".weight") and tensor.dim() == 2:
                    unquantized.add(module_of(name))
                layer = re.match(r"^model\.layers\.(\d+)\.attention\.", name)
                if layer and int(layer.group(1)) in kv_scales and int(layer.group(1)) not in (
                        written_kv):
                    index = int(layer.group(1))
                    for scale_name, value in zip(kv_scale_names(index), kv_scales[index],
                                                 strict=True):
                        tensors[scale_name] = _scalar(value)
                    written_kv.add(index)
                continue
            module = match.group(1)
            if tensor.dim() != 2 or tensor.shape[1] % NVFP4_GROUP_SIZE:
                raise CheckpointError(
                    f"{path.name}: {name} has shape {tuple(tensor.shape)}; NVFP4 needs a 2-D "
                    f"weight whose in_features is a multiple of {NVFP4_GROUP_SIZE}"
                )
            packed, block_scale, scale_2 = quantize_nvfp4(tensor)
            tensors[f"{module}.weight"] = packed
            tensors[f"{module}.weight_scale"] = block_scale
            tensors[f"{module}.weight_scale_2"] = scale_2
            if input_scale is not None:
                tensors[f"{module}.input_scale"] = _scalar(input_scale)
            quantized.add(module)
    return tensors


def export_nvfp4(
    source_dir: str | Path,
    output_dir: str | Path,
    *,
    input_amax: float | None = None,
    kv_scales: Mapping[int, tuple[float, float]] | None = None,
) -> Path:
    """Quantize `source_dir`'s routed experts to NVFP4 and write a ModelOpt export to `output_dir`.

    input_amax: activation amax for every expert's `input_scale` (omitted when None).
    kv_scales: `{layer: (k_scale, v_scale)}` FP8 KV-cache scales (omitted when None).
    Returns `output_dir`.
    """
    source, output = Path(source_dir), Path(output_dir)
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{source}: no *.safetensors files to export")
    config_path = source / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{source}: missing config.json")
    output.mkdir(parents=True, exist_ok=True)
    input_scale = None if input_amax is None else input_amax / (E2M1_MAX * E4M3_MAX)
    kv = dict(kv_scales or {})
    quantized: set[str] = set()
    unquantized: set[str] = set()
    written_kv: set[int] = set()
    weight_map: dict[str, str] = {}
    for shard in shards:
        tensors = _quantize_shard(shard, input_scale, kv, written_kv, quantized, unquantized)
        save_file(tensors, str(output / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    if missing := sorted(set(kv) - written_kv):
        raise CheckpointError(f"kv_scales: no attention tensors found for layers {missing}")
    if not quantized:
        raise CheckpointError(f"{source}: no routed-expert weights (`{EXPERT_WEIGHT.pattern}`)")
    if (source / INDEX_FILE).is_file():
        index = json.loads((source / INDEX_FILE).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (output / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    excludes = _exclude_globs(unquantized, quantized)
    kv_algo = "FP8" if kv else None
    hf_quant = {"producer": _PRODUCER, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": kv_algo, "group_size": NVFP4_GROUP_SIZE,
        "exclude_modules": excludes}}
    (output / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "producer": _PRODUCER,
        "ignore": excludes,
        "config_groups": {"group_0": {"weights": _FP4_SCHEME, "input_activations": _FP4_SCHEME,
                                      "targets": ["Linear"]}},
        **({"kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}} if kv else {}),
    }
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _NOT_COPIED:
            shutil.copy2(path, output / path.name)
    return output
