"""A tiny DiffusionGemma (sliding and full layers, a window smaller than the test contexts) with
seeded random weights, built by `dlmc.models.shapes` without transformers."""

from __future__ import annotations

import torch

from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig, RopeParameters
from dlmc.models.shapes import build_random_diffusion_gemma

VOCAB, CANVAS, WINDOW = 128, 8, 5


def tiny_config(**overrides: object) -> DiffusionGemmaConfig:
    """6 layers (sliding, sliding, full) x 2; sliding head 16 with 2 KV heads, full head 32 with
    1 KV head; 8 experts, top 2; vocabulary 128; canvas 8; window 5."""
    values: dict[str, object] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "layer_types": (SLIDING, SLIDING, FULL) * 2, "sliding_window": WINDOW,
        "sliding_rope": RopeParameters("default", 10_000.0),
        "full_rope": RopeParameters("proportional", 1_000_000.0, partial_rotary_factor=0.25),
        "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 24,
        "canvas_length": CANVAS,
    }
    values.update(overrides)
    return DiffusionGemmaConfig(**values)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               **overrides: object) -> DiffusionGemmaForBlockDiffusion:
    return build_random_diffusion_gemma(tiny_config(**overrides), torch.device(device), dtype,
                                        seed)
