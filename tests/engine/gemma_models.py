"""Tiny random DiffusionGemma models from transformers (the reference), saved as checkpoints
for dlmc, and transformers' `generate` with its sampler's decisions recorded."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_generation

from dlmc.graphs.canvas_settings import CanvasSettings

VOCAB, CANVAS = 96, 8
TEXT = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
    "num_global_key_value_heads": 1, "num_experts": 4, "top_k_experts": 2,
    "moe_intermediate_size": 16, "sliding_window": 5, "max_position_embeddings": 512,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
          "head_dim": 8, "global_head_dim": 8}
ONE_CENTRED = ("norm.weight", "layernorm.weight", "layernorm_1.weight", "layernorm_2.weight",
               "router.scale", "per_expert_scale", "layer_scalar")
EMBED_STD = 1.5  # peaked logits: steps accept several positions, canvases stop early
# Short canvases and few steps, EOS ids that turn up, the stop on confidence alone (a random
# model's argmax is never stable): canvases stop at different steps, EOS cuts, 1 to 3 canvases.
SETTINGS = CanvasSettings(canvas_length=CANVAS, max_denoising_steps=8, confidence_threshold=0.4,
                          entropy_bound=0.5, stability_threshold=0, eos_token_ids=(1, 7, 11),
                          pad_token_id=0, max_new_tokens=24)


def hf_gemma(seed: int, **text_overrides) -> transformers.DiffusionGemmaForBlockDiffusion:
    """transformers' model with seeded random weights (the encoder's layer_scalar buffers
    equal to the decoder's, as a loaded checkpoint has them)."""
    config = transformers.DiffusionGemmaConfig(
        text_config={**TEXT, **text_overrides}, vision_config=VISION, canvas_length=CANVAS)
    config._attn_implementation = "eager"
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    gen = torch.Generator().manual_seed(seed)
    decoder = model.model.decoder
    with torch.no_grad():
        for name, tensor in [*decoder.named_parameters(), *decoder.named_buffers()]:
            if name.endswith(ONE_CENTRED):
                tensor.copy_(0.75 + 0.5 * torch.rand(tensor.shape, generator=gen))
            elif name == "embed_tokens.weight":
                tensor.copy_(EMBED_STD * torch.randn(tensor.shape, generator=gen))
            elif "rotary_emb" not in name and not name.endswith("embed_scale"):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
        for enc, dec in zip(model.model.encoder.language_model.layers, decoder.layers,
                            strict=True):
            enc.layer_scalar.copy_(dec.layer_scalar)
    return model


def save_checkpoint(model: transformers.DiffusionGemmaForBlockDiffusion, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def hf_generate(model, prompt: list[int], seed: int, s: CanvasSettings = SETTINGS
                ) -> tuple[list[int], float, list[list[list[bool]]]]:
    """transformers' `generate` with `torch.manual_seed(seed)`: (the generated ids cut after
    the first EOS, tokens per forward, the accepted mask of every step of every canvas)."""
    canvases: list[list[list[bool]]] = []
    prepare = model._prepare_denoiser_inputs
    accept = hf_generation.EntropyBoundSampler.accept_canvas

    def new_canvas(**kwargs):
        canvases.append([])
        return prepare(**kwargs)

    def recorded_accept(sampler, *args, **kwargs):
        out = accept(sampler, *args, **kwargs)
        canvases[-1].append(sampler.accepted_token_mask[0].tolist())
        return out

    model._prepare_denoiser_inputs = new_canvas
    hf_generation.EntropyBoundSampler.accept_canvas = recorded_accept
    try:
        torch.manual_seed(seed)
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=s.max_new_tokens,
            max_denoising_steps=s.max_denoising_steps, t_min=s.t_min, t_max=s.t_max,
            sampler_config=hf_generation.EntropyBoundSamplerConfig(float(s.entropy_bound)),
            stability_threshold=s.stability_threshold,
            confidence_threshold=float(s.confidence_threshold),
            eos_token_id=list(s.eos_token_ids), pad_token_id=s.pad_token_id)
    finally:
        hf_generation.EntropyBoundSampler.accept_canvas = accept
        del model._prepare_denoiser_inputs
    generated = out.sequences[0, len(prompt):].tolist()
    eos = [i for i, t in enumerate(generated) if t in s.eos_token_ids]
    return generated[: eos[0] + 1] if eos else generated, float(out.tokens_per_forward[0]), (
        canvases)
