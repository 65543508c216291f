"""The built-in `tiny-diffusiongemma` is a real `diffusion_gemma` checkpoint: transformers loads
it, its generation config is the released sampler's, and its tokenizer renders the Gemma 4 chat
format with exactly one <bos>."""

import json

import pytest
import torch

from dlmc.graphs.canvas_settings import canvas_settings_from_generation_config
from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint
from dlmc.loading.tiny_gemma_tokenizer import BOS_ID, BYTE_OFFSET, TURN_CLOSE_ID, TURN_OPEN_ID


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma_checkpoint(tmp_path_factory.mktemp("tiny-gemma"), seed=0)


def test_generation_config_holds_the_released_sampler_settings(tiny):
    raw = json.loads((tiny / "generation_config.json").read_text())
    s = canvas_settings_from_generation_config(raw, canvas_length=32)
    assert (s.max_denoising_steps, s.t_max, s.t_min, s.entropy_bound) == (48, 0.8, 0.4, 0.1)
    assert (s.stability_threshold, s.confidence_threshold) == (1, 0.005)
    assert s.eos_token_ids == (1, 106, 50) and s.pad_token_id == 0


def test_chat_template_is_the_gemma4_format(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
                    "<|turn>model\nHello<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID
    assert ids[1] == TURN_OPEN_ID and ids.count(TURN_CLOSE_ID) == 4
    assert tok("Hi", add_special_tokens=False)["input_ids"] == [BYTE_OFFSET + 72, BYTE_OFFSET + 105]
    assert tok.decode(ids, skip_special_tokens=True) == (
        "system\nBe brief.\nuser\nHi\nmodel\nHello\nuser\n2+2?\nmodel\n")


@torch.no_grad()
def test_transformers_loads_it_and_agrees_with_dlmc(tiny):
    """transformers' encoder logits equal dlmc's, loaded with the default kernels (q/k/v and
    the dense gate/up fused into one weight each)."""
    transformers = pytest.importorskip("transformers")
    from dlmc.loading.loader import load_model
    from dlmc.models.diffusion_gemma_attention import CausalContext

    reference = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(
        str(tiny), dtype=torch.float32).eval()
    loaded = load_model(tiny, torch.device("cpu"), torch.float32)
    layer = loaded.model.model.decoder.layers[0]
    assert layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
    ids = torch.tensor([BOS_ID, TURN_OPEN_ID, 300, 301, 302, TURN_CLOSE_ID])
    hidden = reference.model.encoder(input_ids=ids[None]).last_hidden_state
    want = torch.tanh(reference.lm_head(hidden)[0] / 30.0) * 30.0
    got = loaded.model(ids, torch.arange(6), CausalContext())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
