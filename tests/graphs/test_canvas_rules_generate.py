"""Eager canvas decoding with `dlmc.graphs.canvas_rules` is token-identical to transformers'
`DiffusionGemmaForBlockDiffusion.generate` with the same seed (a tiny random model, CPU).

transformers' decoder forwards are recorded; the dlmc loop replays their logits and must hand
the decoder the very canvas and self-conditioning logits that transformers did, step by step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.configuration_diffusion_gemma import (
    DiffusionGemmaTextConfig,
)

from dlmc.graphs.canvas_rules import denoise_canvas_reference, finish_canvas, tokens_per_forward
from dlmc.graphs.canvas_settings import CanvasSettings

VOCAB, CANVAS = 64, 8
# Logit scale: the tiny model's logits are nearly flat; x100 spreads the entropies so that
# steps accept several positions, rows stop at different steps and EOS ids turn up.
SHARPEN = 100.0
GENERATE = {
    "max_new_tokens": 24, "max_denoising_steps": 6, "confidence_threshold": 0.3,
    "eos_token_id": [1, 10, 20, 30, 40], "pad_token_id": 0,
}


def _tiny_model() -> DiffusionGemmaForBlockDiffusion:
    text = DiffusionGemmaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
        num_global_key_value_heads=1, sliding_window=16, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"],
        enable_moe_block=True,
    )
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=None, canvas_length=CANVAS, image_token_id=63,
        boi_token_id=62, eoi_token_id=61,
    )
    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(config).eval()


def _record_decoder(model: DiffusionGemmaForBlockDiffusion) -> list[tuple]:
    """Wrap `model.forward` (transformers' eager decoder call): sharpen its logits and record
    (canvas, self-conditioning logits or None, logits) per call."""
    calls: list[tuple] = []
    forward = model.forward

    def recorded(**kwargs):
        out = forward(**kwargs)
        out.logits = out.logits * SHARPEN
        sc = kwargs.get("self_conditioning_logits")
        calls.append((kwargs["decoder_input_ids"].clone(),
                      None if sc is None else sc.clone(), out.logits.clone()))
        return out

    model.forward = recorded
    return calls


@pytest.mark.parametrize("first_canvas", [False, True])
def test_eager_decoding_is_token_identical_to_transformers(first_canvas: bool) -> None:
    model = _tiny_model()
    calls = _record_decoder(model)
    prompt = torch.tensor([[2, 5, 7, 9], [2, 11, 13, 17]])
    given = torch.randint(0, VOCAB, (2, CANVAS), generator=torch.Generator().manual_seed(3))
    extra = {"decoder_input_ids": given.clone()} if first_canvas else {}
    torch.manual_seed(1)
    hf = model.generate(prompt, **GENERATE, **extra)

    replay = iter(calls)

    def decoder(canvas: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
        hf_canvas, hf_sc, logits = next(replay)
        assert torch.equal(canvas, hf_canvas)
        assert (sc is None) == (hf_sc is None)
        assert sc is None or torch.equal(sc, hf_sc)
        return logits

    s = CanvasSettings(
        canvas_length=CANVAS, max_denoising_steps=6, confidence_threshold=0.3,
        eos_token_ids=(1, 10, 20, 30, 40), pad_token_id=0, max_new_tokens=24,
    )
    sc_dtype = model.model.decoder.embed_tokens.weight.dtype  # fp32 for this tiny model
    generator = torch.Generator().manual_seed(1)
    finished = torch.zeros(2, dtype=torch.bool)
    forwards = torch.zeros(2, dtype=torch.int32)
    appended = []
    for index in range(s.canvas_count):
        argmax, forwards = denoise_canvas_reference(
            decoder, s, VOCAB, generator, finished, forwards, sc_dtype,
            first_canvas=given if first_canvas and index == 0 else None,
        )
        tokens, finished = finish_canvas(argmax, finished, s)
        appended.append(tokens)
        if bool(finished.all()):
            break
    assert next(replay, None) is None  # as many decoder forwards as transformers ran
    generated = torch.cat(appended, dim=-1)
    assert torch.equal(torch.cat([prompt, generated], dim=-1), hf.sequences)
    assert torch.equal(tokens_per_forward(generated, forwards, 0), hf.tokens_per_forward)
    # the case exercises what it should: rows stopping apart, EOS padding, a 2nd canvas
    assert forwards[0] != forwards[1] and (generated == 0).any() and generated.shape[1] > CANVAS
