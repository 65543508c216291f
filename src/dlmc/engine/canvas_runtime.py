"""What `dlmc.LLM` needs to serve a `diffusion_gemma` checkpoint: its canvas decoder, its
settings and their record, its prompts (text only, exactly one <bos>) and its special ids.

`LLM` keeps its interface for both model types; where DiffusionGemma differs it asks this.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.engine.canvas_config import CanvasDecodeConfig, resolve_canvas_config
from dlmc.engine.canvas_decoder import CanvasDecoder
from dlmc.engine.canvas_steppers import check_canvas_mode, default_canvas_mode
from dlmc.errors import ConfigError
from dlmc.kv.scales import KVScales, resolve_kv_cache_dtype
from dlmc.loading.special_ids import SpecialIds
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

TEXT_PART_TYPES = ("text", "input_text")


class CanvasRuntime:
    """DiffusionGemma's side of `LLM`: `role` "orl" (generation_config.json, then
    paper_decoding.json), `mode` "graph" (the default on CUDA), "compile", "eager" (the
    default elsewhere) or "reference", a static KV cache (`resolve_canvas_kv`): FP8 with the
    checkpoint's per-layer `kv_scales`, or the activation dtype."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, model_dir: Path, role: str,
                 device: torch.device, dtype: torch.dtype, mode: str | None,
                 kv_cache_dtype: str, max_context: int | None, kernels: KernelConfig,
                 kv_scales: KVScales | None = None, declares_fp8: bool = False) -> None:
        self.model, self.model_dir, self.role = model, model_dir, role
        self.config = model.config
        self.mode = mode or default_canvas_mode(device)
        check_canvas_mode(self.mode)
        fp8 = resolve_canvas_kv(kv_cache_dtype, declares_fp8, dtype, self.mode)
        scales = kv_scales or KVScales.ones(self.config.num_hidden_layers)
        self.kv_scales = scales if fp8 else None
        # what the cache holds: "fp8" or the activation dtype's name
        self.kv_cache_dtype = "fp8" if fp8 else str(dtype).removeprefix("torch.")
        self.decoder = CanvasDecoder(model, device, self.mode, max_context, kernels=kernels,
                                     fp8_scales=self.kv_scales)
        self.max_context = self.decoder.max_context
        defaults = self.decode_settings({})  # a bad role or generation config fails here
        eos = defaults.settings.eos_token_ids
        self.special_ids = SpecialIds(
            None, eos[0] if eos else -1,
            f"no mask token (uniform-noise canvas); eos {list(eos)} from "
            f"{defaults.sources['eos_token_ids']}")

    def decode_settings(self, overrides: Mapping[str, Any]) -> CanvasDecodeConfig:
        return resolve_canvas_config(self.role, self.model_dir, self.config, overrides)

    def record(self, cfg: CanvasDecodeConfig, common: Mapping[str, Any]) -> dict[str, Any]:
        """`GenerateResult.settings`: the sampler's effective settings, their sources and
        the engine's (`common`: precision, dtype, device, ...)."""
        return {**cfg.to_dict(), "model_type": "diffusion_gemma",
                "sampler": "entropy_bound", **common, "mode": self.mode,
                "kv_cache_dtype": self.kv_cache_dtype, "self_conditioning_active": True}

    def text_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages with text content only (OpenAI-style text parts joined); an image
        (or any other part) is an error naming it."""
        out = []
        for i, message in enumerate(messages):
            extra = sorted(set(message) & {"images", "image", "image_url", "pixel_values"})
            if extra:
                raise ConfigError(f"messages[{i}].{extra[0]}: {_NO_IMAGES}")
            content = message["content"]
            if isinstance(content, list):
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    if kind not in TEXT_PART_TYPES:
                        raise ConfigError(f"messages[{i}].content[{j}]: a {kind!r} part; "
                                          f"{_NO_IMAGES}")
                content = "".join(part.get("text", "") for part in content)
            out.append({**message, "content": content})
        return out

    def with_bos(self, ids: list[int]) -> list[int]:
        """Exactly one <bos> at the start of a prompt encoded from text (a chat template
        renders it; a raw prompt gets it here)."""
        bos = self.config.bos_token_id
        return ids if ids[:1] == [bos] else [bos, *ids]

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.logits(token_ids)


def resolve_canvas_kv(option: str, declares_fp8: bool, dtype: torch.dtype, mode: str) -> bool:
    """Whether DiffusionGemma's cache holds FP8 K/V: `kv_cache_dtype` as `resolve_kv_cache_dtype`
    resolves it, except that "auto" keeps the activation dtype unless the activations are bf16
    and the mode is not "reference" (whose stepper refuses an explicit "fp8")."""
    fp8 = resolve_kv_cache_dtype(option, declares_fp8) == "fp8"
    if option == "auto":
        return fp8 and dtype == torch.bfloat16 and mode != "reference"
    return fp8


_NO_IMAGES = ("dlmc runs DiffusionGemma's text path only (the vision tower is not loaded), so "
              "requests with images are not supported")
