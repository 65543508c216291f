import json

import pytest

from dlmc.errors import CheckpointError
from dlmc.loading.tiny import TINY_CONFIG
from dlmc.models.config import LLaDA2Config


def test_parses_tiny_config():
    cfg = LLaDA2Config.from_dict(TINY_CONFIG)
    assert cfg.rotary_dim == 8
    assert cfg.num_query_groups == 2
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'.*llada2_moe"):
        LLaDA2Config.from_file(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_key_value_heads", 3, "multiple of `num_key_value_heads`"),
        ("hidden_size", 0, "`hidden_size` must be a positive integer"),
        ("topk_group", 9, "`topk_group`"),
        ("score_function", "softmax", "`score_function`"),
    ],
)
def test_bad_fields_are_named(field, value, message):
    with pytest.raises(CheckpointError, match=message):
        LLaDA2Config.from_dict({**TINY_CONFIG, field: value})


def test_missing_required_key(tmp_path):
    raw = {k: v for k, v in TINY_CONFIG.items() if k != "num_experts"}
    with pytest.raises(CheckpointError, match="missing required key.*num_experts"):
        LLaDA2Config.from_dict(raw)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        LLaDA2Config.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LLaDA2Config.from_file(tmp_path / "config.json")
