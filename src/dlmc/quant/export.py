"""Write a ModelOpt-format NVFP4 export from a BF16 checkpoint directory.

The routed experts are quantized with ModelOpt's max calibration (`quantize_nvfp4`), one
`[out, in]` linear at a time, into `weight` (uint8 `[out, in/2]`), `weight_scale`
(float8_e4m3fn `[out, in/16]`) and `weight_scale_2` (fp32 `[]`); with `input_amax`, also
`input_scale = input_amax / (6 * 448)` (fp32 `[]`, same for every expert, as there is no
calibration data). All other tensors are copied unchanged, shard by shard. The layout follows
config.json's `model_type`:

- `llada2_moe`: `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` are replaced by their
  quantized tensors; FP8 KV-cache scales are written as `model.layers.L.attention.{k,v}_scale`
  (LLaDA2 has one fused `query_key_value` projection, so the scales sit on the attention module).
- `diffusion_gemma`: the stacked `model.decoder.layers.L.experts.gate_up_proj [E, 2I, H]` (rows
  `:I` gate, `I:` up) and `...experts.down_proj [E, H, I]` are split per expert into
  `model.decoder.layers.L.experts.E.{gate,up,down}_proj.*`, as ModelOpt's fused-experts export
  names them; gate and up share one `weight_scale_2` (the amax of the expert's fused gate_up,
  as ModelOpt calibrates it). The BF16 stacks are kept beside them, as the released NVFP4
  exports keep them (inference does not read them). FP8 KV-cache scales are written as
  `model.decoder.layers.L.self_attn.{k,v}_scale`.

With `kv_scales`, `kv_cache_quant_algo` becomes "FP8". Also written: `hf_quant_config.json`,
config.json with a `quantization_config` block, the safetensors index (if the source had one);
tokenizer files, generation_config.json, paper_decoding.json and other non-weight files are
copied.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dlmc.errors import CheckpointError
from dlmc.quant.modelopt_config import HF_QUANT_CONFIG, NVFP4_GROUP_SIZE, module_of
from dlmc.quant.nvfp4_format import (
    E2M1_MAX,
    E4M3_MAX,
    global_scale_from_amax,
    quantize_nvfp4,
)

INDEX_FILE = "model.safetensors.index.json"
_NOT_COPIED = {"config.json", HF_QUANT_CONFIG, INDEX_FILE}
_PRODUCER = {"name": "dlmc", "version": "0.1.0"}
_FP4_SCHEME = {"num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE, "dynamic": False}
# (module name, weight [out, in], global scale shared with another linear or None) per linear.
Linears = list[tuple[str, torch.Tensor, torch.Tensor | None]]


def _llada2_linears(match: re.Match[str], tensor: torch.Tensor) -> Linears:
    return [(match.group(1), tensor, None)]


def _gemma_linears(match: re.Match[str], tensor: torch.Tensor) -> Linears:
    """Stacked `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]` -> one linear
    per expert and projection; gate and up share the global scale of their fused amax."""
    prefix, proj = match.groups()
    if tensor.dim() != 3:
        return [(f"{prefix}.{proj}", tensor, None)]  # rejected by the shape check
    linears: Linears = []
    for e in range(tensor.shape[0]):
        if proj == "down_proj":
            linears.append((f"{prefix}.{e}.down_proj", tensor[e], None))
            continue
        inter = tensor.shape[1] // 2
        shared = global_scale_from_amax(tensor[e].float().abs().amax())
        linears += [(f"{prefix}.{e}.gate_proj", tensor[e, :inter], shared),
                    (f"{prefix}.{e}.up_proj", tensor[e, inter:], shared)]
    return linears


@dataclass(frozen=True)
class ExportLayout:
    """Where a model type keeps its routed experts and its attention, for the exporter."""

    experts: re.Pattern[str]  # a source tensor that holds routed-expert weights
    linears: Callable[[re.Match[str], torch.Tensor], Linears]  # its linears to quantize
    attention: re.Pattern[str]  # group 1: the layer of an attention tensor
    kv_module: str  # `{layer}`-template of the module that carries `k_scale` / `v_scale`
    keep_source: bool  # keep the BF16 expert tensors beside the quantized ones


LAYOUTS = {
    "llada2_moe": ExportLayout(
        re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj))"
                   r"\.weight$"),
        _llada2_linears, re.compile(r"^model\.layers\.(\d+)\.attention\."),
        "model.layers.{layer}.attention", keep_source=False),
    "diffusion_gemma": ExportLayout(
        re.compile(r"^(model\.decoder\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$"),
        _gemma_linears, re.compile(r"^model\.decoder\.layers\.(\d+)\.self_attn\."),
        "model.decoder.layers.{layer}.self_attn", keep_source=True),
}


def kv_scale_names(layer: int, model_type: str = "llada2_moe") -> tuple[str, str]:
    """Tensor names of layer `layer`'s FP8 KV-cache scales in exports written here."""
    prefix = LAYOUTS[model_type].kv_module.format(layer=layer)
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
    path: Path, layout: ExportLayout, input_scale: float | None,
    kv_scales: Mapping[int, tuple[float, float]], written_kv: set[int], quantized: set[str],
    unquantized: set[str],
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = handle.get_tensor(name)
            match = layout.experts.match(name)
            if match is None or layout.keep_source:
                tensors[name] = tensor
            if match is None:
                if name.endswith(".weight") and tensor.dim() == 2:
                    unquantized.add(module_of(name))
                layer = layout.attention.match(name)
                if layer and int(layer.group(1)) in kv_scales and int(layer.group(1)) not in (
                        written_kv):
                    index = int(layer.group(1))
                    prefix = layout.kv_module.format(layer=index)
                    for kind, value in zip("kv", kv_scales[index], strict=True):
                        tensors[f"{prefix}.{kind}_scale"] = _scalar(value)
                    written_kv.add(index)
                continue
            for module, weight, shared_scale in layout.linears(match, tensor):
                if weight.dim() != 2 or weight.shape[1] % NVFP4_GROUP_SIZE:
                    raise CheckpointError(
                        f"{path.name}: {name} holds a weight of shape {tuple(weight.shape)} for "
                        f"{module}; NVFP4 needs a 2-D weight whose in_features is a multiple of "
                        f"{NVFP4_GROUP_SIZE}"
                    )
                packed, block_scale, scale_2 = quantize_nvfp4(weight, shared_scale)
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
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in LAYOUTS:
        raise CheckpointError(f"{config_path}: model_type {model_type!r}: the exporter writes "
                              f"{', '.join(LAYOUTS)}")
    layout = LAYOUTS[model_type]
    output.mkdir(parents=True, exist_ok=True)
    input_scale = None if input_amax is None else input_amax / (E2M1_MAX * E4M3_MAX)
    kv = dict(kv_scales or {})
    quantized: set[str] = set()
    unquantized: set[str] = set()
    written_kv: set[int] = set()
    weight_map: dict[str, str] = {}
    for shard in shards:
        tensors = _quantize_shard(shard, layout, input_scale, kv, written_kv, quantized,
                                  unquantized)
        save_file(tensors, str(output / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    if missing := sorted(set(kv) - written_kv):
        raise CheckpointError(f"kv_scales: no attention tensors found for layers {missing}")
    if not quantized:
        raise CheckpointError(f"{source}: no routed-expert weights (`{layout.experts.pattern}`)")
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
