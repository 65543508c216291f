"""Loading `diffusion_gemma` checkpoints: dlmc's tiny writer and transformers' own
`save_pretrained` output, the tensors that are skipped without being read, and an error that
names the tensor or field for every malformed case."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmc.errors import CheckpointError, ConfigError
from dlmc.loading.gemma_loading import is_skipped
from dlmc.loading.loader import load_model
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint

CPU = torch.device("cpu")


@pytest.fixture()
def ckpt(tmp_path):
    return write_tiny_gemma_checkpoint(tmp_path / "g", seed=5, shards=1, tokenizer=False)


def _edit(ckpt, fn):
    file = ckpt / "model.safetensors"
    sd = load_file(str(file))
    fn(sd)
    save_file(sd, str(file))


def _edit_config(ckpt, fn):
    raw = json.loads((ckpt / "config.json").read_text())
    fn(raw)
    (ckpt / "config.json").write_text(json.dumps(raw))


def test_loads_every_text_tensor_by_its_checkpoint_name(ckpt):
    loaded = load_model(ckpt, CPU, torch.float32)
    sd = load_file(str(ckpt / "model.safetensors"))
    assert loaded.model_type == "diffusion_gemma" and loaded.precision == "bf16"
    state = loaded.model.state_dict()
    assert set(state) == {n for n in sd if n.startswith("model.decoder.")}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32, name  # buffers (layer_scalar) too
        assert torch.equal(tensor, sd[name].float()), name
    layer = loaded.model.model.decoder.layers[2]  # a full layer: K = V, no v_proj
    assert layer.self_attn.v_proj is None and layer.experts.gate_up_proj.shape == (8, 48, 64)
    assert loaded.model.lm_head_weight is loaded.model.model.decoder.embed_tokens.weight


def test_vision_tower_and_encoder_buffers_are_never_read(tmp_path, monkeypatch):
    ckpt = write_tiny_gemma_checkpoint(tmp_path / "g", seed=1, shards=3, tokenizer=False)
    index = SafetensorsIndex(ckpt)
    skipped = {n for n in index.tensors if is_skipped(n)}
    assert any(".vision_tower." in n for n in skipped)
    assert any(n.startswith("model.encoder.embed_vision.") for n in skipped)
    assert any(n.startswith("model.encoder.language_model.layers.") for n in skipped)
    read: list[str] = []
    real_get = SafetensorsIndex.get

    def spy(self, name):
        if is_skipped(name):  # the reader refuses them: loading must not ask
            raise AssertionError(f"read {name}")
        read.append(name)
        return real_get(self, name)

    monkeypatch.setattr(SafetensorsIndex, "get", spy)
    loaded = load_model(ckpt, CPU, torch.float32)
    assert set(read) == set(loaded.model.state_dict()) == set(index.tensors) - skipped
    assert len(read) == len(set(read))  # each tensor read once


def test_unused_tensors_other_than_the_skipped_ones_are_reported(ckpt, caplog):
    _edit(ckpt, lambda sd: sd.__setitem__("model.decoder.layers.2.self_attn.v_proj.weight",
                                          torch.zeros(32, 64, dtype=torch.bfloat16)))
    with caplog.at_level(logging.WARNING):
        load_model(ckpt, CPU, torch.float32)
    assert "1 checkpoint tensor(s) not used" in caplog.text
    assert "layers.2.self_attn.v_proj.weight" in caplog.text and "vision" not in caplog.text


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("model.decoder.layers.4.self_attn.k_proj.weight"),
     r"tensor model.decoder.layers.4.self_attn.k_proj.weight is missing \(expected shape "
     r"\[32, 64\]\)"),
    (lambda sd: sd.pop("model.decoder.self_conditioning.pre_norm.weight"),
     r"tensor model.decoder.self_conditioning.pre_norm.weight is missing"),
    (lambda sd: sd.__setitem__("model.decoder.layers.1.experts.gate_up_proj",
                               torch.zeros(8, 24, 64, dtype=torch.bfloat16)),
     r"model.safetensors: tensor model.decoder.layers.1.experts.gate_up_proj has shape "
     r"\[8, 24, 64\], expected \[8, 48, 64\]"),
    (lambda sd: sd.__setitem__("model.decoder.layers.0.layer_scalar",
                               torch.ones(2, dtype=torch.bfloat16)),
     r"tensor model.decoder.layers.0.layer_scalar has shape \[2\], expected \[1\]"),
    (lambda sd: sd.__setitem__("model.decoder.norm.weight", torch.zeros(64, dtype=torch.uint8)),
     r"tensor model.decoder.norm.weight has dtype U8, expected one of BF16"),
])
def test_malformed_tensors_are_named(ckpt, edit, message):
    _edit(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt, CPU, torch.float32)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw["text_config"].update(num_experts=0),
     r"`text_config.num_experts` must be a positive integer, got 0"),
    (lambda raw: raw["text_config"].update(layer_types=["sliding_attention"] * 6),
     r"`text_config.layer_types\[5\]` \(the last layer\) must be 'full_attention'"),
    (lambda raw: raw["text_config"].pop("sliding_window"),
     r"missing required key\(s\) text_config.sliding_window"),
    (lambda raw: raw.update(canvas_length=-1), r"`canvas_length` must be a positive integer"),
    (lambda raw: raw.update(model_type="gemma4"),
     r"unknown model_type 'gemma4'; dlmc supports llada2_moe, diffusion_gemma"),
])
def test_malformed_config_fields_are_named(ckpt, edit, message):
    _edit_config(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt, CPU, torch.float32)


def test_nvfp4_needs_an_nvfp4_export(ckpt):
    with pytest.raises(ConfigError, match="precision 'nvfp4': .* is a BF16 checkpoint"):
        load_model(ckpt, CPU, torch.float32, precision="nvfp4")
    quant = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                              "exclude_modules": ["lm_head"]}}
    (ckpt / "hf_quant_config.json").write_text(json.dumps(quant))
    # The config marks the experts NVFP4: their BF16 stacks do not stand in for them.
    with pytest.raises(CheckpointError, match=r"model.decoder.layers.0.experts.0.gate_proj.weight: "
                       r"missing .*; the BF16 copy model.decoder.layers.0.experts.gate_up_proj "
                       r"is never read"):
        load_model(ckpt, CPU, torch.float32)


@torch.no_grad()
def test_transformers_saved_checkpoint_loads_with_its_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache

    text = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
            "sliding_window": 4, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]}
    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 8, "global_head_dim": 8}
    config = transformers.DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                               canvas_length=6)
    torch.manual_seed(0)
    reference = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, torch.float32)
    assert loaded.config.global_head_dim == 32  # from transformers' per_layer_config
    prompt, canvas = torch.randint(0, 96, (9,)), torch.randint(0, 96, (6,))
    cache = GemmaKVCache(3)
    got_enc = loaded.model(prompt, torch.arange(9), CausalContext(cache))
    got_dec = loaded.model(canvas, torch.arange(9, 15), CanvasContext(cache), decoder=True)
    hf_cache = transformers.DynamicCache(config=config.get_text_config(decoder=True))
    hidden = reference.model.encoder(input_ids=prompt[None], cache=hf_cache).last_hidden_state
    want_enc = torch.tanh(reference.lm_head(hidden)[0] / 30.0) * 30.0
    want_dec = reference(decoder_input_ids=canvas[None], cache=hf_cache).logits[0]
    torch.testing.assert_close(got_enc, want_enc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dec, want_dec, rtol=1e-5, atol=1e-5)
