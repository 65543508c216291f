"""Precisions of `dlmc bench round --shape diffusiongemma-26b-a4b`: the model with BF16 or NVFP4
routed experts (made directly in their format on the device, `dlmc.models.shapes`), a prefix
cache in the activation dtype or in FP8 with per-layer K/V scales, the KV bytes a step reads
per element, and the option combinations the canvas step does not time (one-line errors).

NVFP4 experts run `dlmc::nvfp4_moe` (W4A16: codes and block scales dequantized in the kernel,
bf16 tensor-core products), so a step's FLOPs and its compute floor are BF16's; its bytes count
each touched expert at its stored size (E2M1 codes, one E4M3 scale per 16 weights, the global
and input scales). An FP8 cache's K/V are read at one byte per element and dequantized in the
attention's gather (`GemmaStaticCache.read`); the canvas's own K/V stay in bf16.
"""

from __future__ import annotations

import torch

from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.models.nvfp4_experts import apply_kernel_config
from dlmc.models.shapes import build_random_diffusion_gemma
from dlmc.quant.nvfp4_format import e4m3

__all__ = ["PRECISIONS", "KV_CACHE_DTYPES", "build_canvas_model", "canvas_option_problem",
           "random_fp8_cache", "fp8_bench_scales", "kv_element_bytes"]

PRECISIONS = ("bf16", "nvfp4")
KV_CACHE_DTYPES = ("bf16", "fp8")
CODE_SPREAD = 64.0  # random FP8 codes N(0, 64): well inside E4M3's +-448, few subnormals


def canvas_option_problem(shape: str, precision: str, kv_cache_dtype: str, kv_layout: str,
                          temperature: float) -> str | None:
    """Why the canvas step cannot be timed with these options (one line naming the option and
    `shape`), or None."""
    if precision not in PRECISIONS:
        return f"--shape {shape}: --precision {precision}: expected one of {', '.join(PRECISIONS)}"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return (f"--shape {shape}: --kv-cache-dtype {kv_cache_dtype}: expected one of "
                f"{', '.join(KV_CACHE_DTYPES)}")
    if kv_layout == "paged":
        return (f"--shape {shape}: --kv-layout paged: DiffusionGemma's cache is the dense static "
                "cache (use --kv-layout auto or dense)")
    if temperature:
        return (f"--shape {shape}: --temperature {temperature}: the canvas step's temperature "
                "is its schedule's (t_min .. t_max); leave --temperature at 0")
    return None


def build_canvas_model(config: DiffusionGemmaConfig, device: torch.device, precision: str,
                       kernels: KernelConfig, seed: int = 0) -> DiffusionGemmaForBlockDiffusion:
    """The model of `config` with seeded random BF16 weights on `device`, its routed experts
    in `precision` ("bf16", or "nvfp4": made directly as NVFP4, never in BF16 first), the
    NVFP4 op taking `kernels`' choices."""
    model = build_random_diffusion_gemma(config, device, torch.bfloat16, seed,
                                         nvfp4_experts=precision == "nvfp4")
    apply_kernel_config(model, kernels)
    return model


def fp8_bench_scales(num_layers: int) -> KVScales:
    """Per-layer K and V scales of the benchmark's FP8 cache: distinct per layer and between K
    and V (about amax / 448 of unit-variance K/V), so a mixed-up scale shows in the values."""
    return KVScales(tuple((1.0 + i / num_layers) / CODE_SPREAD for i in range(num_layers)),
                    tuple((2.0 - i / num_layers) / CODE_SPREAD for i in range(num_layers)))


def random_fp8_cache(model: DiffusionGemmaForBlockDiffusion, prefix: int, canvas: int,
                     gen: torch.Generator) -> GemmaStaticCache:
    """An FP8 cache (`fp8_bench_scales`) of `prefix` positions holding random codes
    N(0, 64) (dequantized: about unit variance), with room for the canvas after them."""
    device = model.lm_head_weight.device
    scales = fp8_bench_scales(model.config.num_hidden_layers)
    cache = GemmaStaticCache(model.config, prefix + canvas, model.lm_head_weight.dtype, device,
                             fp8_scales=scales)
    for codes in (*cache.k, *cache.v):
        values = torch.randn(codes.shape, device=device, generator=gen) * CODE_SPREAD
        codes.copy_(e4m3(values))
    cache.length.fill_(prefix)
    return cache


def kv_element_bytes(cache: GemmaStaticCache) -> int:
    """Bytes per cached K or V element: 1 for FP8, else the activation dtype's size."""
    return cache.k[0].element_size()
