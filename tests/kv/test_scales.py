"""KV-cache dtype resolution and FP8 KV scales found under the plausible tensor names."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dlmc.errors import CheckpointError, ConfigError
from dlmc.kv.scales import (
    checkpoint_declares_fp8_kv,
    find_kv_scale_names,
    load_kv_scales,
    resolve_kv_cache_dtype,
)


@pytest.mark.parametrize(
    ("k_name", "v_name"),
    [
        ("model.layers.{L}.attention.k_scale", "model.layers.{L}.attention.v_scale"),
        ("model.layers.{L}.attention.query_key_value.k_scale",
         "model.layers.{L}.attention.query_key_value.v_scale"),
        ("model.layers.{L}.attention.key_value.k_scale",
         "model.layers.{L}.attention.key_value.v_scale"),
        ("model.layers.{L}.self_attn.k_proj.k_scale", "model.layers.{L}.self_attn.v_proj.v_scale"),
        ("model.layers.{L}.self_attn.k_proj.output_scale",
         "model.layers.{L}.self_attn.v_proj.output_scale"),
        ("model.layers.{L}.self_attn.attn.k_scale", "model.layers.{L}.self_attn.attn.v_scale"),
        ("model.decoder.layers.{L}.self_attn.k_proj.k_scale",
         "model.decoder.layers.{L}.self_attn.v_proj.v_scale"),
        ("model.decoder.layers.{L}.self_attn.k_scale",
         "model.decoder.layers.{L}.self_attn.v_scale"),
        ("model.encoder.language_model.layers.{L}.self_attn.k_scale",
         "model.encoder.language_model.layers.{L}.self_attn.v_scale"),
    ],
)
def test_plausible_names_are_found(k_name: str, v_name: str) -> None:
    names = ["model.layers.0.attention.query_key_value.weight", "model.layers.0.mlp.gate.weight"]
    for layer in range(3):
        names += [k_name.format(L=layer), v_name.format(L=layer)]
    found = find_kv_scale_names(names, num_layers=3)
    assert found == {
        layer: {"k": k_name.format(L=layer), "v": v_name.format(L=layer)} for layer in range(3)
    }


def test_unrelated_scales_are_ignored() -> None:
    names = [
        "model.layers.0.attention.query_key_value.weight_scale",
        "model.layers.0.attention.query_key_value.input_scale",
        "model.layers.0.attention.dense.output_scale",  # not a k/v projection
        "model.layers.1.mlp.experts.0.down_proj.weight_scale_2",
        "model.layers.9.attention.k_scale",  # past num_layers
    ]
    assert find_kv_scale_names(names, num_layers=2) == {}


def test_most_specific_name_wins(caplog: pytest.LogCaptureFixture) -> None:
    names = ["model.layers.0.self_attn.k_proj.output_scale", "model.layers.0.self_attn.k_scale",
             "model.layers.0.self_attn.k_proj.k_scale"]
    with caplog.at_level(logging.WARNING):
        found = find_kv_scale_names(names, num_layers=1)
    assert found == {0: {"k": "model.layers.0.self_attn.k_proj.k_scale"}}
    assert "several k-scale tensors" in caplog.text


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Path]:
    save_file(tensors, str(path))
    return dict.fromkeys(tensors, path)


def test_load_scales_and_warn_for_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weight_map = write_checkpoint(tmp_path / "model.safetensors", {
        "model.layers.0.attention.query_key_value.k_scale": torch.tensor(0.25),
        "model.layers.0.attention.query_key_value.v_scale": torch.tensor([0.5]),
        "model.layers.1.attention.query_key_value.k_scale": torch.tensor(2.0),
        "model.layers.0.attention.dense.weight": torch.zeros(2, 2),
    })
    with caplog.at_level(logging.WARNING):
        scales = load_kv_scales(weight_map, num_layers=3, declares_fp8=True)
    assert scales.k == (0.25, 2.0, 1.0)
    assert scales.v == (0.5, 1.0, 1.0)
    assert "no scale for 3 of 6" in caplog.text and "v1" in caplog.text


def test_no_warning_when_fp8_is_not_declared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weight_map = write_checkpoint(tmp_path / "a.safetensors", {"lm_head.weight": torch.zeros(1)})
    with caplog.at_level(logging.WARNING):
        scales = load_kv_scales(weight_map, num_layers=2, declares_fp8=False)
    assert scales.k == (1.0, 1.0) and scales.v == (1.0, 1.0)
    assert caplog.text == ""


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor(0.0),
                                 torch.tensor(float("nan"))])
def test_bad_scale_names_the_tensor(tmp_path: Path, bad: torch.Tensor) -> None:
    weight_map = write_checkpoint(tmp_path / "a.safetensors",
                                  {"model.layers.0.self_attn.k_proj.k_scale": bad})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.k_scale"):
        load_kv_scales(weight_map, num_layers=1, declares_fp8=True)


def test_declared_fp8() -> None:
    assert checkpoint_declares_fp8_kv({"quantization": {"kv_cache_quant_algo": "FP8"}})
    assert not checkpoint_declares_fp8_kv({"quantization": {"kv_cache_quant_algo": None}})
    assert not checkpoint_declares_fp8_kv({"quantization": {"quant_algo": "NVFP4"}})
    scheme = {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    assert checkpoint_declares_fp8_kv(None, scheme)
    assert not checkpoint_declares_fp8_kv(None, {"quantization_config": {}})
    assert not checkpoint_declares_fp8_kv(None, None)


def test_resolve_kv_cache_dtype() -> None:
    assert resolve_kv_cache_dtype("auto", declares_fp8=True) == "fp8"
    assert resolve_kv_cache_dtype("auto", declares_fp8=False) == "bf16"
    assert resolve_kv_cache_dtype("bf16", declares_fp8=True) == "bf16"
    assert resolve_kv_cache_dtype("fp8", declares_fp8=False) == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp16'"):
        resolve_kv_cache_dtype("fp16", declares_fp8=False)
