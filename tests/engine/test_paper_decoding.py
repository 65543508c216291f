import json
import logging
from dataclasses import replace

import pytest

from dlmc.engine.decode_config import DecodeConfig, resolve_decode_config, role_defaults
from dlmc.errors import ConfigError


def write(tmp_path, data):
    (tmp_path / "paper_decoding.json").write_text(json.dumps(data))
    return tmp_path


def test_missing_file_gives_paper_defaults(tmp_path):
    cfg = resolve_decode_config("orl", tmp_path, {})
    assert (cfg.threshold, cfg.edit_threshold, cfg.max_refine_steps) == (0.85, 0.5, 16)
    assert cfg.max_new_tokens == 4096 and cfg.block_length == 32 and cfg.algorithm == "joint"


def test_nested_aliases_case_and_dashes(tmp_path):
    write(
        tmp_path,
        {
            "Tau-Mask": 0.7,
            "orl": {"editing_threshold": "0.4", "Max-Post-Steps": 8, "tau_mask": 0.8},
            "gen_length": 100,
        },
    )
    cfg = resolve_decode_config("orl", tmp_path, {})
    assert (cfg.threshold, cfg.edit_threshold, cfg.max_refine_steps) == (0.8, 0.4, 8)
    assert cfg.max_new_tokens == 100


def test_bad_and_unknown_values_warn_and_fall_back(tmp_path, caplog):
    write(tmp_path, {"threshold": 7, "refine_steps": "many", "colour": "blue"})
    with caplog.at_level(logging.WARNING):
        cfg = resolve_decode_config("orl", tmp_path, {})
    assert cfg.threshold == 0.85 and cfg.max_refine_steps == 16
    text = caplog.text
    assert "'threshold' has invalid value 7" in text and "'refine_steps'" in text
    assert "unknown key 'colour'" in text and "paper_decoding.json" in text


@pytest.mark.parametrize("value", [None, False])
def test_null_or_false_disables_edits(tmp_path, value):
    write(tmp_path, {"edit_threshold": value})
    assert resolve_decode_config("orl", tmp_path, {}).edit_threshold is None


def test_request_beats_file_beats_defaults(tmp_path):
    write(tmp_path, {"threshold": 0.6, "edit_threshold": 0.3})
    cfg = resolve_decode_config("orl", tmp_path, {"threshold": 0.9})
    assert (cfg.threshold, cfg.edit_threshold) == (0.9, 0.3)


@pytest.mark.parametrize("role", ["orl", "llada2.1", "llada2.0"])
def test_the_checkpoint_file_applies_under_every_role(tmp_path, role):
    """paper_decoding.json describes the checkpoint: it beats every role's defaults, and
    explicit arguments beat it. The LLaDA2.1-only settings (edit threshold, refine steps) do
    not exist in the LLaDA2.0 threshold rule, so they are not applied there."""
    write(tmp_path, {"threshold": 0.6, "edit_threshold": 0.3, "refine_steps": 5,
                     "gen_length": 300, "block_length": 16, "temperature": 0.4})
    cfg = resolve_decode_config(role, tmp_path, {})
    assert (cfg.threshold, cfg.max_new_tokens, cfg.block_length, cfg.temperature) == (
        0.6, 300, 16, 0.4)
    joint = role != "llada2.0"
    assert (cfg.edit_threshold, cfg.max_refine_steps) == ((0.3, 5) if joint else (None, 0))
    assert cfg.algorithm == role_defaults(role).algorithm
    given = {"threshold": 0.9, "edit_threshold": 0.7, "max_refine_steps": 2,
             "max_new_tokens": 50, "block_length": 8, "temperature": 0.0}
    assert resolve_decode_config(role, tmp_path, given) == replace(role_defaults(role), **given)


@pytest.mark.parametrize("role", ["orl", "llada2.1", "llada2.0"])
def test_generation_config_does_not_set_llada2_decoding(tmp_path, role):
    """generation_config.json carries the special ids only (docs/llada2.md §4, §6): the same keys in
    it and in paper_decoding.json take paper_decoding.json's values, and without that file the
    role's."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 77, "temperature": 0.7, "threshold": 0.1, "block_length": 8}))
    assert resolve_decode_config(role, tmp_path, {}) == role_defaults(role)
    write(tmp_path, {"max_new_tokens": 99, "temperature": 0.2, "threshold": 0.3,
                     "block_length": 64})
    cfg = resolve_decode_config(role, tmp_path, {})
    assert (cfg.max_new_tokens, cfg.temperature, cfg.threshold, cfg.block_length) == (
        99, 0.2, 0.3, 64)


def test_every_setting_of_every_role_default():
    """docs/llada2.md §5.3 (llada2.0), §5.4 (llada2.1) and §6 (orl), field by field."""
    common = {"steps": 32, "block_length": 32, "temperature": 0.0, "top_k": None,
              "top_p": None, "seed": None, "num_to_transfer": 1}
    assert role_defaults("orl").to_dict() == {
        **common, "algorithm": "joint", "threshold": 0.85, "edit_threshold": 0.5,
        "max_refine_steps": 16, "max_new_tokens": 4096, "self_conditioning": True}
    assert role_defaults("llada2.1").to_dict() == {
        **common, "algorithm": "joint", "threshold": 0.95, "edit_threshold": 0.9,
        "max_refine_steps": 16, "max_new_tokens": 2048, "self_conditioning": False}
    assert role_defaults("llada2.0").to_dict() == {
        **common, "algorithm": "threshold", "threshold": 0.95, "edit_threshold": None,
        "max_refine_steps": 0, "max_new_tokens": 2048, "self_conditioning": False}
    assert DecodeConfig() == replace(role_defaults("orl"), self_conditioning=False)


def test_roles_and_validation():
    assert role_defaults("llada2.0").algorithm == "threshold"
    with pytest.raises(ConfigError, match="role 'gpt'"):
        role_defaults("gpt")
    with pytest.raises(ConfigError, match="`block_length`"):
        DecodeConfig(block_length=0)
    with pytest.raises(ConfigError, match="`edit_threshold`"):
        DecodeConfig(edit_threshold=1.5)
