"""ModelOpt config parsing: supported configs, exclude globs, and one error per malformed field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from dlmc.errors import CheckpointError
from dlmc.quant.modelopt_config import (
    load_quant_config,
    module_of,
    parse_hf_quant_config,
    parse_quantization_config,
)

HF = {"producer": {"name": "modelopt", "version": "0.37"},
      "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                       "exclude_modules": ["lm_head", "model.layers.*.mlp.gate",
                                           "model.layers.*.attention*", "model.word_embeddings"]}}
SCHEME = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
CONFIG_BLOCK = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"weights": SCHEME, "input_activations": SCHEME,
                                              "targets": ["Linear"]}},
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}


def test_nvfp4_exclude_globs() -> None:
    config = parse_hf_quant_config(HF)
    assert config.kv_cache_fp8 and config.producer == "modelopt"
    assert config.is_quantized("model.layers.3.mlp.experts.7.down_proj")
    assert config.is_quantized("model.layers.3.mlp.shared_experts.up_proj")
    assert not config.is_quantized("model.layers.3.mlp.gate")
    assert not config.is_quantized("model.layers.12.attention.query_key_value")
    assert not config.is_quantized("lm_head")
    assert config.is_quantized("lm_head_extra")  # exact names are not prefixes


def test_mixed_precision_quantized_layers() -> None:
    data = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16}}}}
    config = parse_hf_quant_config(data)
    assert config.is_quantized("model.layers.1.mlp.experts.0.gate_proj")
    assert not config.is_quantized("model.layers.1.mlp.experts.0.up_proj")
    assert config.kv_cache_quant_algo is None


def test_config_json_block() -> None:
    config = parse_quantization_config(CONFIG_BLOCK)
    assert config.kv_cache_fp8 and config.exclude_modules == ("lm_head",)
    assert not config.is_quantized("lm_head")


def test_load_prefers_hf_quant_config(tmp_path: Path) -> None:
    assert load_quant_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": CONFIG_BLOCK}))
    assert load_quant_config(tmp_path).exclude_modules == ("lm_head",)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF))
    assert len(load_quant_config(tmp_path).exclude_modules) == 4
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="hf_quant_config.json: invalid JSON"):
        load_quant_config(tmp_path)


def _with(path: list[str], value: Any, base: dict = HF) -> dict:
    data = copy.deepcopy(base)
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize(("data", "message"), [
    (_with(["quantization"], KeyError), "missing field `quantization`"),
    (_with(["quantization", "quant_algo"], "FP8"), "`quant_algo` 'FP8' is not supported"),
    (_with(["quantization", "quant_algo"], "NVFP4_AWQ"), "`quant_algo` 'NVFP4_AWQ'"),
    (_with(["quantization", "quant_algo"], KeyError), "missing field `quant_algo`"),
    (_with(["quantization", "group_size"], 32), "`group_size` must be 16"),
    (_with(["quantization", "group_size"], KeyError), "missing field `group_size`"),
    (_with(["quantization", "group_size"], "16"), "field `group_size` has the wrong type"),
    (_with(["quantization", "kv_cache_quant_algo"], "INT8"), "`kv_cache_quant_algo` 'INT8'"),
    (_with(["quantization", "exclude_modules"], "lm_head"), "`exclude_modules` must be a list"),
    (_with(["quantization", "quant_algo"], "MIXED_PRECISION"), "`quantized_layers` must be"),
    (_with(["quantization", "quantized_layers"], {"a": {"quant_algo": "FP8"}},
           _with(["quantization", "quant_algo"], "MIXED_PRECISION")),
     r"`quantized_layers.a`.quant_algo: 'FP8'"),
    (_with(["quantization", "quantized_layers"], {"a": {"quant_algo": "NVFP4", "group_size": 8}},
           _with(["quantization", "quant_algo"], "MIXED_PRECISION")),
     r"`quantized_layers.a`.group_size must be 16"),
    ([1, 2], "expected a JSON object"),
])
def test_hf_quant_config_errors(data: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as error:
        parse_hf_quant_config(data)
    assert "hf_quant_config.json" in str(error.value)


@pytest.mark.parametrize(("data", "message"), [
    (_with(["quant_method"], "compressed-tensors", CONFIG_BLOCK), "`quant_method`"),
    (_with(["quant_algo"], "MXFP4", CONFIG_BLOCK), "`quant_algo` 'MXFP4'"),
    (_with(["config_groups", "group_0", "weights", "num_bits"], 8, CONFIG_BLOCK),
     r"`config_groups.group_0.weights` must be 4-bit float"),
    (_with(["config_groups", "group_0", "weights", "group_size"], 32, CONFIG_BLOCK),
     "`group_size` must be 16"),
    (_with(["kv_cache_scheme"], {"num_bits": 4, "type": "int"}, CONFIG_BLOCK),
     "`kv_cache_scheme`"),
    (_with(["ignore"], [1], CONFIG_BLOCK), "`ignore` must be a list"),
])
def test_quantization_config_errors(data: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as error:
        parse_quantization_config(data)
    assert "config.json (quantization_config)" in str(error.value)


def test_module_of() -> None:
    assert module_of("a.b.weight_scale_2") == "a.b"
    assert module_of("a.b.weight_scale") == "a.b"
    assert module_of("a.attention.k_scale") == "a.attention"
    assert module_of("a.b.input_scale") == "a.b"
