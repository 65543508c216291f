"""CanvasSettings: validation, and reading a checkpoint's generation_config.json."""

from __future__ import annotations

import json

import pytest
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    EntropyBoundSamplerConfig,
)

from dlmc.errors import ConfigError
from dlmc.graphs.canvas_settings import (
    CanvasSettings,
    canvas_settings_from_generation_config,
)


def _checkpoint_file() -> dict:
    """The checkpoint's generation_config.json as transformers writes it (docs/diffusiongemma.md
    §2 values)."""
    config = DiffusionGemmaGenerationConfig(
        max_denoising_steps=48, max_new_tokens=256,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), t_max=0.8, t_min=0.4,
        stability_threshold=1, confidence_threshold=0.005, eos_token_id=[1, 106, 50],
        pad_token_id=0, bos_token_id=2,
    )
    return json.loads(config.to_json_string())


def test_reads_the_checkpoint_file_as_transformers_does() -> None:
    data = _checkpoint_file()
    assert data["sampler_config"]["_cls_name"] == "EntropyBoundSamplerConfig"
    s = canvas_settings_from_generation_config(data, canvas_length=256)
    hf = DiffusionGemmaGenerationConfig(**_checkpoint_file())
    assert (s.max_denoising_steps, s.t_min, s.t_max) == (hf.max_denoising_steps, hf.t_min, hf.t_max)
    assert s.entropy_bound == hf.sampler_config.entropy_bound
    assert (s.stability_threshold, s.confidence_threshold) == (
        hf.stability_threshold, hf.confidence_threshold)
    assert s.eos_token_ids == tuple(hf.eos_token_id) == (1, 106, 50)
    assert (s.pad_token_id, s.max_new_tokens, s.canvas_length) == (0, 256, 256)
    assert s == CanvasSettings()  # the dataclass defaults are the checkpoint's


def test_missing_keys_take_transformers_defaults() -> None:
    s = canvas_settings_from_generation_config(
        {"pad_token_id": 0, "eos_token_id": 1, "t_min": None}, canvas_length=32
    )
    defaults = DiffusionGemmaGenerationConfig._get_default_generation_params()
    assert s.max_new_tokens == defaults["max_new_tokens"]
    assert s.max_denoising_steps == defaults["max_denoising_steps"]
    assert s.entropy_bound == defaults["sampler_config"].entropy_bound
    assert (s.t_min, s.t_max) == (defaults["t_min"], defaults["t_max"])
    assert s.stability_threshold == defaults["stability_threshold"]
    assert s.confidence_threshold == defaults["confidence_threshold"]
    assert (s.eos_token_ids, s.canvas_length) == ((1,), 32)
    no_eos = canvas_settings_from_generation_config({"pad_token_id": 0}, canvas_length=32)
    assert no_eos.eos_token_ids == ()


def test_overrides_win() -> None:
    s = canvas_settings_from_generation_config(
        _checkpoint_file(), canvas_length=256,
        overrides={"entropy_bound": 0.5, "max_denoising_steps": 12, "t_max": None,
                   "eos_token_ids": [1], "max_new_tokens": 1000},
    )
    assert (s.entropy_bound, s.max_denoising_steps, s.t_max) == (0.5, 12, 0.8)
    assert s.eos_token_ids == (1,) and s.canvas_count == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("canvas_length", 0),
        ("max_denoising_steps", 0),
        ("max_denoising_steps", 2.0),
        ("t_min", -0.1),
        ("t_max", 0.4),  # not above t_min
        ("entropy_bound", 0.0),
        ("stability_threshold", -1),
        ("stability_threshold", True),
        ("confidence_threshold", 0.0),
        ("confidence_threshold", float("nan")),
        ("eos_token_ids", [1, 106]),
        ("eos_token_ids", (1, -2)),
        ("pad_token_id", 1),  # an EOS id
        ("max_new_tokens", 0),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"CanvasSettings.{field} must be"):
        CanvasSettings(**{field: value})


def test_file_errors_name_the_file_and_key() -> None:
    with pytest.raises(ConfigError, match="unknown canvas setting.*'temperature'"):
        canvas_settings_from_generation_config({}, 8, overrides={"temperature": 1.0})
    with pytest.raises(ConfigError, match="g.json: pad_token_id is missing"):
        canvas_settings_from_generation_config({}, 8, source="g.json")
    other = {"pad_token_id": 0, "sampler_config": {"_cls_name": "DiscreteDDIMSamplerConfig",
                                                   "entropy_bound": 0.1}}
    with pytest.raises(ConfigError, match="sampler_config._cls_name must be"):
        canvas_settings_from_generation_config(other, 8)
    with pytest.raises(ConfigError, match="eos_token_id must be"):
        canvas_settings_from_generation_config({"pad_token_id": 0, "eos_token_id": "1"}, 8)
    with pytest.raises(ConfigError, match="generation_config.json or its overrides: "
                                          "CanvasSettings.t_max must be"):
        canvas_settings_from_generation_config({"pad_token_id": 0, "t_max": 0.2}, 8)
