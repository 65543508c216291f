"""`kv_cache_dtype` resolution and FP8 KV scales from a checkpoint's tensor names.

ModelOpt writes `k_scale = amax_k / 448` (fp32 scalar) under the k/v projection names, e.g.
`model.layers.L.self_attn.k_proj.k_scale` (docs/nvfp4.md §1.3, §2.7). For LLaDA2's fused
`attention.query_key_value` projection the names are not documented, so every plausible
spelling is accepted: a `k_scale`/`v_scale` leaf anywhere under the layer's attention module
(`attention.k_scale`, `attention.query_key_value.k_scale`, `attention.key_value.k_scale`,
`self_attn.attn.k_scale`, ...), or an `output_scale` under a k/v projection
(`self_attn.k_proj.output_scale`). DiffusionGemma's layers sit under `model.decoder.` (or the
tied encoder's `model.encoder.language_model.`). A checkpoint that declares an FP8 KV cache but
carries no scale for a layer gets 1.0 and a warning.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dlmc.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
KVCacheDtype = Literal["bf16", "fp8"]

_SCALE_NAME = re.compile(
    r"^(?:model\.)?(?:decoder\.|encoder\.language_model\.|language_model\.(?:model\.)?)?"
    r"layers\.(?P<layer>\d+)\."
    r"(?:attention|self_attn)\.(?P<sub>(?:\w+\.)*?)(?P<leaf>k_scale|v_scale|output_scale)$"
)
_OUTPUT_SCALE_OWNERS = {"k_proj.": "k", "key.": "k", "v_proj.": "v", "value.": "v"}


def checkpoint_declares_fp8_kv(
    hf_quant_config: Mapping[str, Any] | None, config: Mapping[str, Any] | None = None
) -> bool:
    """True when `hf_quant_config.json` (or config.json's `quantization_config`) says FP8 KV.

    `hf_quant_config.json`: `quantization.kv_cache_quant_algo == "FP8"`; config.json:
    `quantization_config.kv_cache_scheme = {num_bits: 8, type: "float"}` (docs/nvfp4.md §1.1, §1.2).
    """
    if hf_quant_config:
        quant = hf_quant_config.get("quantization", hf_quant_config)
        algo = quant.get("kv_cache_quant_algo") if isinstance(quant, Mapping) else None
        if algo is not None:
            return str(algo).upper() == "FP8"
    quant_config = (config or {}).get("quantization_config") or {}
    scheme = quant_config.get("kv_cache_scheme") if isinstance(quant_config, Mapping) else None
    if isinstance(scheme, Mapping):
        return scheme.get("num_bits") == 8 and scheme.get("type") == "float"
    return False


def resolve_kv_cache_dtype(option: str, declares_fp8: bool) -> KVCacheDtype:
    """`kv_cache_dtype` option → storage: `auto` is FP8 when the checkpoint declares it."""
    if option not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={option!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if option == "auto":
        return "fp8" if declares_fp8 else "bf16"
    return "fp8" if option == "fp8" else "bf16"


def _priority(kind: str, sub: str, leaf: str) -> tuple[int, str]:
    # Prefer an explicit `k_scale` leaf under the k/v projection or the fused projection, then
    # other `k_scale` leaves, then `output_scale` of a k/v projection.
    if leaf == "output_scale":
        return 2, sub
    preferred = ("k_proj.", "v_proj.", "query_key_value.", "key_value.", "qkv_proj.")
    return (0 if sub in preferred else 1), sub


def find_kv_scale_names(names: Iterable[str], num_layers: int) -> dict[int, dict[str, str]]:
    """Per layer, the tensor names of its K and V scales: `{layer: {"k": name, "v": name}}`.

    Layers or kinds without a scale are absent. Several candidates for one slot: the most
    specific wins (see `_priority`) and the others are logged.
    """
    candidates: dict[tuple[int, str], list[tuple[tuple[int, str], str]]] = {}
    for name in names:
        match = _SCALE_NAME.match(name)
        if match is None:
            continue
        layer, sub, leaf = int(match["layer"]), match["sub"], match["leaf"]
        if leaf == "output_scale":
            owner = next((k for s, k in _OUTPUT_SCALE_OWNERS.items() if sub.endswith(s)), None)
            if owner is None:
                continue
            kind = owner
        else:
            kind = leaf[0]
        if layer < num_layers:
            candidates.setdefault((layer, kind), []).append((_priority(kind, sub, leaf), name))
    found: dict[int, dict[str, str]] = {}
    for (layer, kind), options in sorted(candidates.items()):
        options.sort()
        if len(options) > 1:
            log.warning("layer %d has several %s-scale tensors %s; using %s", layer, kind,
                        [n for _, n in options], options[0][1])
        found.setdefault(layer, {})[kind] = options[0][1]
    return found


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 dequantization scales (`x = fp8 * scale`); 1.0 where none was found."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


def _read_scalar(name: str, path: Path) -> float:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensor = handle.get_tensor(name)
    if tensor.numel() != 1:
        raise CheckpointError(f"KV scale {name} in {path} has shape {tuple(tensor.shape)}; "
                              "expected a scalar")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise CheckpointError(f"KV scale {name} in {path} is {value}; expected a positive "
                              "finite number")
    return value


def load_kv_scales(
    weight_map: Mapping[str, Path], num_layers: int, *, declares_fp8: bool
) -> KVScales:
    """Read every layer's K/V scale from the safetensors files of a `name -> file` map.

    Missing scales become 1.0; when the checkpoint `declares_fp8` that is logged as a warning
    naming the layers (ModelOpt's recommended default, docs/nvfp4.md §2.7).
    """
    names = find_kv_scale_names(weight_map, num_layers)
    k, v, missing = [], [], []
    for layer in range(num_layers):
        slots = names.get(layer, {})
        for kind, out in (("k", k), ("v", v)):
            name = slots.get(kind)
            if name is None:
                missing.append(f"{kind}{layer}")
                out.append(1.0)
            else:
                out.append(_read_scalar(name, Path(weight_map[name])))
    if missing and declares_fp8:
        log.warning(
            "checkpoint declares an FP8 KV cache but has no scale for %d of %d K/V slots (%s); "
            "using 1.0 for them", len(missing), 2 * num_layers, ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else ""))
    return KVScales(tuple(k), tuple(v))
