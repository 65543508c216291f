"""Parsing a `diffusion_gemma` config.json and the errors a malformed one raises."""

import copy
import json

import pytest
import torch

from dlmc.errors import CheckpointError
from dlmc.models.diffusion_gemma_config import DEFAULT_ROPE, DiffusionGemmaConfig

PATTERN = ["sliding_attention"] * 5 + ["full_attention"]
# The released google/diffusiongemma-26B-A4B-it config.json, text-relevant keys.
RELEASED = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "eos_token_id": [1, 106],
    "image_token_id": 258880,
    "tie_word_embeddings": True,
    "vision_config": {"model_type": "gemma4_vision", "hidden_size": 1152},
    "text_config": {
        "model_type": "diffusion_gemma_text", "attention_bias": False, "bos_token_id": 2,
        "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 512,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816,
        "intermediate_size": 2112, "layer_types": PATTERN * 5,
        "max_position_embeddings": 262144, "moe_intermediate_size": 704,
        "num_attention_heads": 16, "num_experts": 128, "num_global_key_value_heads": 2,
        "num_hidden_layers": 30, "num_key_value_heads": 8, "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8,
        "use_bidirectional_attention": "vision", "vocab_size": 262144,
    },
}


def _with(text: dict | None = None, **top) -> dict:
    raw = copy.deepcopy(RELEASED)
    raw["text_config"].update(text or {})
    raw.update(top)
    return raw


def test_parses_the_released_config():
    cfg = DiffusionGemmaConfig.from_dict(RELEASED)
    full = [i for i in range(30) if not cfg.is_sliding(i)]
    assert full == [5, 11, 17, 23, 29]
    assert (cfg.layer_head_dim(0), cfg.layer_kv_heads(0), cfg.layer_window(0)) == (256, 8, 1024)
    assert (cfg.layer_head_dim(5), cfg.layer_kv_heads(5), cfg.layer_window(5)) == (512, 2, None)
    assert cfg.full_rope.rotated_pairs(512) == 64 and cfg.full_rope.rope_theta == 1e6
    assert cfg.sliding_rope.rotated_pairs(256) == 128 and cfg.sliding_rope.rope_theta == 1e4
    assert (cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size) == (128, 8, 704)
    assert cfg.eos_token_ids == (1, 106) and cfg.canvas_length == 256
    assert cfg.final_logit_softcapping == 30.0 and cfg.pad_token_id == 0
    assert round(cfg.embed_scale, 3) == 53.066


def test_transformers_saved_form_equals_the_released_form():
    """transformers writes `per_layer_config` instead of the global head keys."""
    text = {k: v for k, v in RELEASED["text_config"].items()
            if k not in ("global_head_dim", "num_global_key_value_heads")}
    text["per_layer_config"] = {str(i): {"head_dim": 512, "num_key_value_heads": 2}
                                for i in (5, 11, 17, 23, 29)}
    saved = {**RELEASED, "text_config": text}
    assert DiffusionGemmaConfig.from_dict(saved) == DiffusionGemmaConfig.from_dict(RELEASED)


@pytest.mark.parametrize("raw", [RELEASED, _with(
    {"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 5e5,
                                            "partial_rotary_factor": 0.5, "factor": 2.0}}},
    image_token_id=7, boi_token_id=8, eoi_token_id=9, canvas_length=64)])
def test_to_dict_reads_back_to_an_equal_config(raw):
    cfg = DiffusionGemmaConfig.from_dict(raw)
    written = cfg.to_dict()
    assert DiffusionGemmaConfig.from_dict(json.loads(json.dumps(written))) == cfg
    assert written["text_config"]["rope_parameters"] == {
        k: {**DEFAULT_ROPE[k], **v} for k, v in raw["text_config"]["rope_parameters"].items()} | {
        k: v for k, v in DEFAULT_ROPE.items() if k not in raw["text_config"]["rope_parameters"]}


def test_to_dict_builds_transformers_model_of_the_same_parameter_shapes():
    """transformers' text model from `to_dict()` has dlmc's parameter names and shapes at full
    size (both built on the meta device)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf

    from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
    from dlmc.models.shapes import DIFFUSIONGEMMA_26B_A4B as FULL_SIZE

    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 8, "global_head_dim": 8}
    config = transformers.DiffusionGemmaConfig(**{**FULL_SIZE.to_dict(),
                                                  "vision_config": vision})
    with torch.device("meta"):
        theirs = hf.DiffusionGemmaForBlockDiffusion(config)
        ours = DiffusionGemmaForBlockDiffusion(FULL_SIZE)
    want = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if k in want}
    assert got == want
    assert sum(v.numel() for v in ours.parameters()) > 25e9


def test_defaults_follow_transformers():
    text = {k: v for k, v in RELEASED["text_config"].items()
            if k not in ("global_head_dim", "num_global_key_value_heads", "rope_parameters",
                         "final_logit_softcapping")}
    cfg = DiffusionGemmaConfig.from_dict({**RELEASED, "text_config": text, "eos_token_id": 1})
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (512, 8)
    assert cfg.full_rope.rope_type == "proportional" and cfg.full_rope.partial_rotary_factor == 0.25
    assert cfg.final_logit_softcapping == 30.0 and cfg.eos_token_ids == (1,)


@pytest.mark.parametrize("key", ["num_experts", "layer_types", "sliding_window", "head_dim"])
def test_missing_text_key_is_named(key):
    raw = _with()
    del raw["text_config"][key]
    with pytest.raises(CheckpointError, match=f"missing required key.*text_config.{key}"):
        DiffusionGemmaConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ({"layer_types": PATTERN * 4}, r"`text_config.layer_types` must list one type per layer"),
        ({"layer_types": PATTERN * 4 + ["sliding_attention", "local", "sliding_attention",
                                        "sliding_attention", "sliding_attention",
                                        "full_attention"]},
         r"`text_config.layer_types\[25\]` must be one of"),
        ({"layer_types": PATTERN * 4 + ["full_attention"] + ["sliding_attention"] * 5},
         r"`text_config.layer_types\[29\]` \(the last layer\) must be 'full_attention'"),
        ({"layer_types": "sliding_attention"}, r"`text_config.layer_types` must be a list"),
        ({"num_global_key_value_heads": 3},
         r"multiple of `text_config.num_global_key_value_heads`"),
        ({"hidden_size": 0}, r"`text_config.hidden_size` must be a positive integer"),
        ({"top_k_experts": 129}, r"`text_config.top_k_experts` \(129\) exceeds"),
        ({"hidden_activation": "silu"}, r"`text_config.hidden_activation`"),
        ({"global_head_dim": 511}, r"`text_config.global_head_dim` must be even"),
        ({"use_bidirectional_attention": "all"}, r"`text_config.use_bidirectional_attention`"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}},
         r"`text_config.rope_parameters.full_attention.rope_type` must be one of"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}}},
         r"`text_config.rope_parameters.sliding_attention` with rope_type 'default'"),
        ({"rope_parameters": {"full_attention": {"rope_type": "proportional"}}},
         r"`text_config.rope_parameters.full_attention` must be an object with"),
        ({"per_layer_config": {"5": {"head_dim": 512}}},
         r"`text_config.per_layer_config` must give every full_attention layer"),
    ],
)
def test_bad_text_fields_are_named(text, message):
    with pytest.raises(CheckpointError, match=message):
        DiffusionGemmaConfig.from_dict(_with(text))


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"model_type": "gemma4"}, r"model_type 'gemma4' is not 'diffusion_gemma'"),
        ({"text_config": None}, r"`text_config` must be an object"),
        ({"tie_word_embeddings": False}, r"`tie_word_embeddings` must be true"),
        ({"canvas_length": -1}, r"`canvas_length` must be a positive integer"),
        ({"eos_token_id": []}, r"`eos_token_id` must be a token id"),
    ],
)
def test_bad_top_level_fields_are_named(top, message):
    with pytest.raises(CheckpointError, match=message):
        DiffusionGemmaConfig.from_dict(_with(**top))


def test_from_file(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError, match="config.json not found"):
        DiffusionGemmaConfig.from_file(path)
    path.write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        DiffusionGemmaConfig.from_file(path)
    path.write_text(json.dumps(_with({"num_experts": None})))
    with pytest.raises(CheckpointError, match=f"{path}: missing required key.*num_experts"):
        DiffusionGemmaConfig.from_file(path)
    path.write_text(json.dumps(RELEASED))
    assert DiffusionGemmaConfig.from_file(path) == DiffusionGemmaConfig.from_dict(RELEASED)
