import json
import logging

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
    assert resolve_decode_config("llada2.1", tmp_path, {}).threshold == 0.95  # file is ORL's


def test_roles_and_validation():
    assert role_defaults("llada2.0").algorithm == "threshold"
    with pytest.raises(ConfigError, match="role 'gpt'"):
        role_defaults("gpt")
    with pytest.raises(ConfigError, match="`block_length`"):
        DecodeConfig(block_length=0)
    with pytest.raises(ConfigError, match="`edit_threshold`"):
        DecodeConfig(edit_threshold=1.5)
