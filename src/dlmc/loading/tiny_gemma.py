"""The built-in `tiny-diffusiongemma`: the real `diffusion_gemma` architecture and checkpoint
format (config.json with `text_config`, `model.decoder.*` tensors, fused
`experts.gate_up_proj`, a few vision-tower tensors and the encoder's duplicate `layer_scalar`
buffers that loading skips, generation_config.json with the sampler's settings, a Gemma 4 chat
template), small and with seeded random weights: its output is gibberish.

`tiny-diffusiongemma-nvfp4` (`write_tiny_gemma_nvfp4`) is the same model with 32-wide experts
(NVFP4 needs multiples of 16) exported by dlmc's NVFP4 writer in the ModelOpt format: per-expert
NVFP4 tensors, the BF16 expert copies kept beside them as the released exports keep them, and
FP8 KV-cache scales.

`write_tiny_gemma_checkpoint` is also what the tests use to build checkpoints of their own.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dlmc.loading.tiny_gemma_tokenizer import (
    BOI_ID,
    BOS_ID,
    BYTE_OFFSET,
    EOI_ID,
    EOS_ID,
    IMAGE_ID,
    PAD_ID,
    TINY_GEMMA_VOCAB_SIZE,
    TOOL_RESPONSE_ID,
    TURN_CLOSE_ID,
    write_tiny_gemma_tokenizer,
)
from dlmc.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig

TINY_NVFP4_MOE_INTERMEDIATE = 32  # the NVFP4 variant's expert width (a multiple of 16)
TINY_NVFP4_KV_SCALE = 0.01  # its FP8 KV scales (about amax / 448 of its normed K and V)
TINY_NVFP4_INPUT_AMAX = 8.0  # its experts' activation amax (input_scale = amax / 2688)
EMBED_STD = 0.6  # printable bytes: peaked logits through the tied lm_head
STOP_EMBED_STD = 0.45  # <eos>, <turn|>: likely enough that some answers end early
WEAK_EMBED_STD = 0.02  # every other row

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "diffusion_gemma_text",
    "vocab_size": TINY_GEMMA_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "layer_types": [SLIDING, SLIDING, FULL] * 2,
    "sliding_window": 24,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
               "rope_theta": 1_000_000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "use_bidirectional_attention": "vision",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
TINY_VISION_CONFIG = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
                      "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8}
# The released checkpoints' sampler settings (generation_config.json), a short output.
TINY_GENERATION_CONFIG: dict[str, Any] = {
    "max_new_tokens": 96,
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_max": 0.8,
    "t_min": 0.4,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "bos_token_id": BOS_ID,
    "eos_token_id": [EOS_ID, TURN_CLOSE_ID, TOOL_RESPONSE_ID],
    "pad_token_id": PAD_ID,
}


def tiny_gemma_config_json(**text_overrides: Any) -> dict[str, Any]:
    """The tiny checkpoint's config.json (overrides apply to `text_config`)."""
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": 32,
        "image_token_id": IMAGE_ID,
        "boi_token_id": BOI_ID,
        "eoi_token_id": EOI_ID,
        "eos_token_id": [EOS_ID, TURN_CLOSE_ID],
        "tie_word_embeddings": True,
        "text_config": {**TINY_TEXT_CONFIG, **text_overrides},
        "vision_config": TINY_VISION_CONFIG,
        "dtype": "bfloat16",
    }


def tiny_gemma_state_dict(config: DiffusionGemmaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 tensors with the checkpoint's names and shapes (docs/diffusiongemma.md §3)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def near_one(*shape: int) -> torch.Tensor:
        return (1 + torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)

    def mlp(prefix: str) -> None:
        sd[f"{prefix}.gate_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
        sd[f"{prefix}.up_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
        sd[f"{prefix}.down_proj.weight"] = rand(hidden, inter, std=inter**-0.5)

    row_std = torch.full((config.vocab_size, 1), WEAK_EMBED_STD)
    row_std[BYTE_OFFSET + 32:BYTE_OFFSET + 127] = EMBED_STD
    row_std[[EOS_ID, TURN_CLOSE_ID]] = STOP_EMBED_STD
    d = "model.decoder"
    sd = {f"{d}.embed_tokens.weight": (torch.randn(config.vocab_size, hidden, generator=gen)
                                       * row_std).to(torch.bfloat16),
          f"{d}.norm.weight": near_one(hidden),
          f"{d}.self_conditioning.pre_norm.weight": near_one(hidden)}
    mlp(f"{d}.self_conditioning")
    experts, moe_inter = config.num_experts, config.moe_intermediate_size
    for layer in range(config.num_hidden_layers):
        p = f"{d}.layers.{layer}"
        heads, kv, dim = (config.num_attention_heads, config.layer_kv_heads(layer),
                          config.layer_head_dim(layer))
        sd[f"{p}.self_attn.q_proj.weight"] = rand(heads * dim, hidden, std=hidden**-0.5)
        sd[f"{p}.self_attn.k_proj.weight"] = rand(kv * dim, hidden, std=hidden**-0.5)
        if config.is_sliding(layer):
            sd[f"{p}.self_attn.v_proj.weight"] = rand(kv * dim, hidden, std=hidden**-0.5)
        sd[f"{p}.self_attn.o_proj.weight"] = rand(hidden, heads * dim, std=(heads * dim)**-0.5)
        sd[f"{p}.self_attn.q_norm.weight"] = near_one(dim)
        sd[f"{p}.self_attn.k_norm.weight"] = near_one(dim)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            sd[f"{p}.{norm}.weight"] = near_one(hidden)
        mlp(f"{p}.mlp")
        sd[f"{p}.router.proj.weight"] = rand(experts, hidden, std=hidden**-0.5)
        sd[f"{p}.router.scale"] = near_one(hidden)
        sd[f"{p}.router.per_expert_scale"] = near_one(experts)
        sd[f"{p}.experts.gate_up_proj"] = rand(experts, 2 * moe_inter, hidden, std=hidden**-0.5)
        sd[f"{p}.experts.down_proj"] = rand(experts, hidden, moe_inter, std=moe_inter**-0.5)
        sd[f"{p}.layer_scalar"] = near_one(1)
        # the encoder's copy of the buffer, which loading skips
        sd[f"model.encoder.language_model.layers.{layer}.layer_scalar"] = (
            sd[f"{p}.layer_scalar"].clone())
    vision = TINY_VISION_CONFIG["hidden_size"]
    sd["model.encoder.embed_vision.embedding_projection.weight"] = rand(hidden, vision, std=0.1)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[f"model.encoder.vision_tower.encoder.layers.0.self_attn.{proj}.linear.weight"] = (
            rand(vision, vision, std=0.1))
    return sd


def write_tiny_gemma_checkpoint(
    directory: Path, seed: int = 0, shards: int = 2, tokenizer: bool = True,
    **text_overrides: Any,
) -> Path:
    """Write a tiny `diffusion_gemma` checkpoint to `directory`: config.json,
    generation_config.json, safetensors (sharded with an index, or one file for `shards=1`)
    and, with `tokenizer`, a byte-level tokenizer with a Gemma 4 chat template."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = tiny_gemma_config_json(**text_overrides)
    sd = tiny_gemma_state_dict(DiffusionGemmaConfig.from_dict(raw), seed)
    if shards == 1:
        save_file({n: t.contiguous() for n, t in sd.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        _write_shards(directory, sd, shards)
    _write_json(directory / "config.json", raw)
    _write_json(directory / "generation_config.json", TINY_GENERATION_CONFIG)
    if tokenizer:
        write_tiny_gemma_tokenizer(directory)
    return directory


def write_tiny_gemma_nvfp4(directory: Path, seed: int = 0, shards: int = 2,
                           tokenizer: bool = True) -> Path:
    """Write `tiny-diffusiongemma-nvfp4` to `directory`: a tiny BF16 checkpoint with 32-wide
    experts, exported by `dlmc.quant.export.export_nvfp4` (input scales, FP8 KV scales)."""
    from dlmc.quant.export import export_nvfp4

    layers = TINY_TEXT_CONFIG["num_hidden_layers"]
    source = Path(tempfile.mkdtemp(prefix="tiny-gemma-bf16-"))
    try:
        write_tiny_gemma_checkpoint(source, seed=seed, shards=shards, tokenizer=tokenizer,
                                    moe_intermediate_size=TINY_NVFP4_MOE_INTERMEDIATE)
        return export_nvfp4(source, directory, input_amax=TINY_NVFP4_INPUT_AMAX,
                            kv_scales={i: (TINY_NVFP4_KV_SCALE,) * 2 for i in range(layers)})
    finally:
        shutil.rmtree(source, ignore_errors=True)


def _write_shards(directory: Path, sd: dict[str, torch.Tensor], shards: int) -> None:
    """The text weights round-robin over `shards - 1` files, the skipped tensors (vision tower,
    encoder buffers) in the last one, as the released checkpoints keep them apart."""
    skipped = [n for n in sd if n.startswith("model.encoder.")]
    text = [n for n in sd if not n.startswith("model.encoder.")]
    groups = [text[i::shards - 1] for i in range(shards - 1)] + [skipped]
    weight_map: dict[str, str] = {}
    for shard, names in enumerate(groups):
        fname = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: sd[n].contiguous() for n in names}, str(directory / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    _write_json(directory / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
