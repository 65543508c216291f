"""Parse and validate ModelOpt quantization configs (`hf_quant_config.json` or config.json's
`quantization_config`) into a frozen `QuantConfig` (docs/nvfp4.md §1.1-1.2).

Supported: `quant_algo` "NVFP4" with `group_size` 16 (and "MIXED_PRECISION" whose
`quantized_layers` are all NVFP4/16), `kv_cache_quant_algo` "FP8" or none. Anything else raises a
`CheckpointError` naming the file and field.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlmc.errors import CheckpointError

HF_QUANT_CONFIG = "hf_quant_config.json"
SUPPORTED_ALGOS = ("NVFP4", "MIXED_PRECISION")
SUPPORTED_KV_ALGOS = ("FP8",)
NVFP4_GROUP_SIZE = 16
TENSOR_SUFFIXES = ("weight_scale_2", "weight_scale", "input_scale", "weight", "bias",
                   "k_scale", "v_scale")


@dataclass(frozen=True)
class QuantConfig:
    """What a ModelOpt export quantizes.

    `exclude_modules`: fnmatch globs (case-sensitive, `*` also matches dots) of modules that stay
    unquantized (NVFP4). `quantized_layers`: the exact modules that are quantized
    (MIXED_PRECISION; every other module stays unquantized). `source`: file the config came from.
    """

    quant_algo: str
    group_size: int = NVFP4_GROUP_SIZE
    exclude_modules: tuple[str, ...] = ()
    quantized_layers: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    producer: str | None = None
    source: str = HF_QUANT_CONFIG

    def __post_init__(self) -> None:
        if self.quant_algo not in SUPPORTED_ALGOS:
            raise CheckpointError(
                f"{self.source}: `quant_algo` {self.quant_algo!r} is not supported "
                f"(expected one of {SUPPORTED_ALGOS})"
            )
        if self.group_size != NVFP4_GROUP_SIZE:
            raise CheckpointError(
                f"{self.source}: `group_size` must be {NVFP4_GROUP_SIZE} for NVFP4, "
                f"got {self.group_size!r}"
            )
        if self.kv_cache_quant_algo not in (None, *SUPPORTED_KV_ALGOS):
            raise CheckpointError(
                f"{self.source}: `kv_cache_quant_algo` {self.kv_cache_quant_algo!r} is not "
                f"supported (expected null or one of {SUPPORTED_KV_ALGOS})"
            )

    @property
    def kv_cache_fp8(self) -> bool:
        """True when the export carries FP8 KV-cache scales (`k_scale`/`v_scale`)."""
        return self.kv_cache_quant_algo == "FP8"

    def is_quantized(self, module_name: str) -> bool:
        """Whether `module_name` (e.g. `model.layers.1.mlp.experts.0.gate_proj`) is NVFP4."""
        if self.quant_algo == "MIXED_PRECISION":
            return module_name in self.quantized_layers
        return not any(fnmatch.fnmatchcase(module_name, p) for p in self.exclude_modules)


def module_of(tensor_name: str) -> str:
    """`model.x.gate_proj.weight_scale` -> `model.x.gate_proj` (strips a known tensor suffix)."""
    for suffix in TENSOR_SUFFIXES:
        if tensor_name.endswith("." + suffix):
            return tensor_name[: -len(suffix) - 1]
    return tensor_name


def _field(data: Mapping[str, Any], key: str, source: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise CheckpointError(f"{source}: missing field `{key}`")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{source}: field `{key}` has the wrong type ({value!r})")
    return value


def _string_list(value: Any, source: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{source}: `{key}` must be a list of module names/globs")
    return tuple(value)


def _quantized_layers(value: Any, source: str) -> tuple[str, ...]:
    if not isinstance(value, Mapping) or not value:
        raise CheckpointError(
            f"{source}: `quantized_layers` must be a non-empty mapping for MIXED_PRECISION"
        )
    for module, spec in value.items():
        where = f"{source}: `quantized_layers.{module}`"
        if not isinstance(spec, Mapping):
            raise CheckpointError(f"{where} must be a mapping with `quant_algo`")
        if spec.get("quant_algo") != "NVFP4":
            raise CheckpointError(
                f"{where}.quant_algo: {spec.get('quant_algo')!r} is not supported (expected NVFP4)"
            )
        if spec.get("group_size", NVFP4_GROUP_SIZE) != NVFP4_GROUP_SIZE:
            raise CheckpointError(
                f"{where}.group_size must be {NVFP4_GROUP_SIZE}, got {spec.get('group_size')!r}"
            )
    return tuple(value)


def parse_hf_quant_config(data: Mapping[str, Any], source: str = HF_QUANT_CONFIG) -> QuantConfig:
    """Parse the contents of `hf_quant_config.json`."""
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{source}: expected a JSON object")
    quant = _field(data, "quantization", source, Mapping)
    where = f"{source} (quantization)"
    algo = _field(quant, "quant_algo", where, str)
    group_size = NVFP4_GROUP_SIZE if algo == "MIXED_PRECISION" and "group_size" not in quant else (
        _field(quant, "group_size", where, int))
    producer = data.get("producer")
    layers = _quantized_layers(quant.get("quantized_layers"), where) if (
        algo == "MIXED_PRECISION") else ()
    return QuantConfig(
        quant_algo=algo,
        group_size=group_size,
        exclude_modules=_string_list(quant.get("exclude_modules"), where, "exclude_modules"),
        quantized_layers=layers,
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        producer=producer.get("name") if isinstance(producer, Mapping) else None,
        source=where,
    )


def parse_quantization_config(data: Mapping[str, Any], source: str = "config.json") -> QuantConfig:
    """Parse config.json's `quantization_config` (ModelOpt's llm-compressor-style copy)."""
    where = f"{source} (quantization_config)"
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{where}: expected a JSON object")
    method = data.get("quant_method")
    if method != "modelopt":
        raise CheckpointError(f"{where}: `quant_method` {method!r} is not supported "
                              "(expected 'modelopt')")
    algo = _field(data, "quant_algo", where, str)
    group_size = NVFP4_GROUP_SIZE
    groups = data.get("config_groups") or {}
    for name, group in groups.items() if isinstance(groups, Mapping) else ():
        weights = group.get("weights", {}) if isinstance(group, Mapping) else {}
        if weights.get("num_bits", 4) != 4 or weights.get("type", "float") != "float":
            raise CheckpointError(f"{where}: `config_groups.{name}.weights` must be 4-bit float, "
                                  f"got {weights!r}")
        group_size = weights.get("group_size", group_size)
    kv_scheme = data.get("kv_cache_scheme")
    kv_algo = None
    if kv_scheme is not None:
        if not isinstance(kv_scheme, Mapping) or kv_scheme.get("num_bits") != 8 or (
                kv_scheme.get("type") != "float"):
            raise CheckpointError(f"{where}: `kv_cache_scheme` {kv_scheme!r} is not supported "
                                  "(expected {num_bits: 8, type: float})")
        kv_algo = "FP8"
    layers = _quantized_layers(data.get("quantized_layers"), where) if (
        algo == "MIXED_PRECISION") else ()
    producer = data.get("producer")
    return QuantConfig(
        quant_algo=algo,
        group_size=group_size,
        exclude_modules=_string_list(data.get("ignore"), where, "ignore"),
        quantized_layers=layers,
        kv_cache_quant_algo=kv_algo,
        producer=producer.get("name") if isinstance(producer, Mapping) else None,
        source=where,
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: invalid JSON ({error})") from error


def load_quant_config(checkpoint_dir: str | Path) -> QuantConfig | None:
    """Read `hf_quant_config.json`, else config.json's `quantization_config`; None if neither."""
    directory = Path(checkpoint_dir)
    hf_path = directory / HF_QUANT_CONFIG
    if hf_path.is_file():
        return parse_hf_quant_config(_read_json(hf_path), str(hf_path))
    config_path = directory / "config.json"
    if config_path.is_file():
        block = _read_json(config_path).get("quantization_config")
        if block is not None:
            return parse_quantization_config(block, str(config_path))
    return None
