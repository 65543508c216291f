"""DiffusionGemma's settings: generation_config.json < paper_decoding.json < arguments, with
their sources; LLaDA2's options and bad values are refused by name."""

import json
import logging

import pytest

from dlmc.engine.canvas_config import resolve_canvas_config
from dlmc.errors import ConfigError
from dlmc.loading.tiny_gemma import tiny_gemma_config_json
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig

CONFIG = DiffusionGemmaConfig.from_dict(tiny_gemma_config_json())


def checkpoint(tmp_path, generation=None, paper=None):
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if paper is not None:
        (tmp_path / "paper_decoding.json").write_text(json.dumps(paper))
    return tmp_path


RELEASED = {"max_denoising_steps": 48, "max_new_tokens": 256, "t_max": 0.8, "t_min": 0.4,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
            "stability_threshold": 1, "confidence_threshold": 0.005,
            "eos_token_id": [1, 106, 50], "pad_token_id": 0}


def test_generation_config_then_arguments(tmp_path):
    path = checkpoint(tmp_path, {**RELEASED, "max_denoising_steps": 20})
    cfg = resolve_canvas_config("orl", path, CONFIG, {"t_min": 0.3, "seed": 7,
                                                      "threshold": None, "temperature": 0.0})
    s = cfg.settings
    assert (s.max_denoising_steps, s.t_min, s.t_max, s.entropy_bound) == (20, 0.3, 0.8, 0.1)
    assert s.canvas_length == 32 and s.eos_token_ids == (1, 106, 50) and cfg.seed == 7
    assert cfg.block_length == 32 and cfg.max_new_tokens == 256
    assert cfg.sources["t_min"] == "argument" and cfg.sources["t_max"] == "generation_config.json"
    assert cfg.sources["entropy_bound"] == "generation_config.json"
    record = cfg.to_dict()
    assert record["eos_token_ids"] == [1, 106, 50] and record["seed"] == 7
    assert record["sources"]["max_denoising_steps"] == "generation_config.json"


def test_without_a_generation_config_transformers_defaults_and_config_ids(tmp_path):
    cfg = resolve_canvas_config("orl", tmp_path, CONFIG, {})
    s = cfg.settings
    assert (s.max_denoising_steps, s.max_new_tokens, s.confidence_threshold) == (48, 256, 0.005)
    assert s.eos_token_ids == CONFIG.eos_token_ids == (1, 106) and s.pad_token_id == 0
    assert cfg.sources["eos_token_ids"] == "config.json" and cfg.sources["t_max"] == "default"


def test_paper_decoding_applies_its_sampler_keys_only(tmp_path, caplog):
    paper = {"decoding": {"max_new_tokens": 512, "threshold": 0.85, "edit_threshold": 0.5,
                          "t_max": 0.9, "confidence_threshold": 0.9, "entropy_bound": -1,
                          "colour": "blue"}}
    path = checkpoint(tmp_path, RELEASED, paper)
    with caplog.at_level(logging.INFO):
        cfg = resolve_canvas_config("orl", path, CONFIG, {"max_new_tokens": 64})
    s = cfg.settings
    assert (s.max_new_tokens, s.t_max, s.entropy_bound) == (64, 0.9, 0.1)
    assert s.confidence_threshold == 0.005  # LLaDA2's commit threshold in that file
    assert cfg.sources["t_max"] == "paper_decoding.json"
    assert cfg.sources["max_new_tokens"] == "argument"
    assert "'threshold' is a LLaDA2 decoding setting" in caplog.text
    assert "'confidence_threshold' is a LLaDA2 decoding setting" in caplog.text
    assert "'entropy_bound' has invalid value -1" in caplog.text
    assert "unknown key 'colour'" in caplog.text


@pytest.mark.parametrize(("given", "message"), [
    ({"threshold": 0.9}, r"decoding option `threshold`: a LLaDA2 setting"),
    ({"edit_threshold": None}, r"decoding option `edit_threshold`: a LLaDA2 setting"),
    ({"temperature": 0.7}, r"`temperature`: a LLaDA2 setting.*follows t_max \.\. t_min"),
    ({"top_p": 0.9}, r"`top_p`: a LLaDA2 setting"),
    ({"steps": 4}, r"unknown decoding option `steps`"),
    ({"t_min": -1.0}, r"decoding option `t_min`: .*must be a number >= 0, got -1.0"),
    ({"t_min": 0.9}, r"decoding option `t_max`: .*must be a number > t_min \(0.9\)"),
    ({"max_new_tokens": 0}, r"decoding option `max_new_tokens`"),
    ({"seed": -3}, r"decoding option `seed`: expected an integer in \[0, 2\*\*63 - 1\]"),
])
def test_bad_arguments_are_named(tmp_path, given, message):
    path = checkpoint(tmp_path, RELEASED)
    with pytest.raises(ConfigError, match=message):
        resolve_canvas_config("orl", path, CONFIG, given)


def test_roles_and_a_malformed_generation_config(tmp_path):
    with pytest.raises(ConfigError, match="role 'llada2.1': a diffusion_gemma checkpoint takes "
                                          "role 'orl'"):
        resolve_canvas_config("llada2.1", tmp_path, CONFIG, {})
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        resolve_canvas_config("orl", tmp_path, CONFIG, {})
