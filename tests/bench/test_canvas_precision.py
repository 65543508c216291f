"""`dlmc bench round --shape diffusiongemma-26b-a4b --precision nvfp4 --kv-cache-dtype fp8` on
the CPU: the bytes of a step at the full shape (NVFP4 experts with their block scales, FP8 K/V
at one byte), NVFP4 experts made directly in their format, the FP8 prefix cache with per-layer
scales, a timed eager step over both, and the option errors."""

from __future__ import annotations

import pytest
import torch

from dlmc.bench.canvas_bench import (
    CanvasBenchConfig,
    floors,
    random_cache,
    step_bytes,
    step_flops,
    time_steps,
    use_uniform_routing,
)
from dlmc.bench.canvas_precision import (
    build_canvas_model,
    canvas_option_problem,
    fp8_bench_scales,
    kv_element_bytes,
    random_fp8_cache,
)
from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.nvfp4_experts import NVFP4Experts
from dlmc.models.shapes import DIFFUSIONGEMMA_26B_A4B
from tests.models.gemma_tiny import VOCAB, tiny_config

CANVAS, PREFIX = 8, 20
SHAPE = "diffusiongemma-26b-a4b"


def _meta_model(nvfp4: bool) -> DiffusionGemmaForBlockDiffusion:
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(DIFFUSIONGEMMA_26B_A4B).to(torch.bfloat16)
    if nvfp4:
        for layer in model.model.decoder.layers:
            layer.experts = NVFP4Experts(128, 2816, 704, activation="gelu_tanh", device="meta")
    return model


def test_step_bytes_with_nvfp4_experts_and_an_fp8_cache_at_the_full_shape():
    """Every expert touched: codes (half a byte a weight) + one E4M3 scale per 16 weights +
    the fp32 global and input scales of each projection; K/V at one byte. About 20.6 GB in
    all, 12.8 GB of it experts (45.7 GB in BF16): the floor at 4.24 TB/s is 4.86 ms."""
    bf16 = step_bytes(_meta_model(False), 256, 1024, [128] * 30)
    parts = step_bytes(_meta_model(True), 256, 1024, [128] * 30, kv_bytes=1)
    weights = 3 * 2816 * 704
    assert parts["experts"] == 30 * 128 * (weights // 2 + weights // 16 + 3 * 2 * 4)
    assert round(parts["experts"] / 1e9, 2) == 12.85
    assert parts["kv"] * 2 == bf16["kv"] == 2 * 2 * (25 * 1023 * 8 * 256 + 5 * 1024 * 2 * 512)
    assert parts["weights"] == bf16["weights"] and parts["vocab"] == bf16["vocab"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert round(parts["total"] / 1e9, 1) == 20.6 and round(bf16["total"] / 1e9, 1) == 53.6
    flops = step_flops(_meta_model(True), 256, 1024)
    assert flops == step_flops(_meta_model(False), 256, 1024)  # W4A16: the same products
    limits = floors(parts["total"], flops, 4240.0, 790.0)
    assert limits["bandwidth_floor_ms"] == pytest.approx(4.86, abs=0.01)
    assert limits["compute_floor_ms"] == pytest.approx(3.20, abs=0.01)
    assert limits["binds"] == "bandwidth"


@torch.no_grad()
def test_nvfp4_experts_are_made_in_their_format():
    config = tiny_config(moe_intermediate_size=32)  # NVFP4 rows: multiples of 16
    model = build_canvas_model(config, torch.device("cpu"), "nvfp4", KernelConfig(pdl=False))
    experts = [layer.experts for layer in model.model.decoder.layers]
    assert all(isinstance(e, NVFP4Experts) and e.activation == "gelu_tanh" for e in experts)
    assert all(e.use_reference and not e.pdl for e in experts)  # CPU: the op's reference
    codes = experts[0].gate_proj_weight
    assert codes.dtype == torch.uint8 and codes.shape == (8, 32, 32)
    assert 100 < codes.float().mean() < 155  # uniform bytes
    scales = experts[0].down_proj_weight_scale.float()
    assert scales.min() >= 0.5 and scales.max() <= 2.0
    assert torch.equal(experts[3].up_proj_weight_scale_2, torch.full((8,), 0.02))
    assert not any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == 3
                   for e in experts for t in e.buffers())
    plain = build_canvas_model(config, torch.device("cpu"), "bf16", KernelConfig())
    assert not any(isinstance(m, NVFP4Experts) for m in plain.modules())
    assert plain.lm_head_weight.dtype == model.lm_head_weight.dtype == torch.bfloat16


@torch.no_grad()
def test_fp8_cache_holds_codes_with_per_layer_scales_and_a_step_runs():
    config = tiny_config(moe_intermediate_size=32)
    model = build_canvas_model(config, torch.device("cpu"), "nvfp4", KernelConfig())
    cache = random_fp8_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(0))
    assert cache.fp8 and cache.k[0].dtype == torch.float8_e4m3fn and kv_element_bytes(cache) == 1
    assert int(cache.length) == PREFIX and cache.max_tokens == PREFIX + CANVAS
    scales = fp8_bench_scales(6)
    assert (cache.k_scales, cache.v_scales) == (scales.k, scales.v)
    assert len(set(scales.k)) == 6 and scales.k[0] != scales.v[0]
    k, _ = cache.read(2, cache.k[2], cache.v[2])
    assert 0.7 < k.float().std() / (1 + 2 / 6) < 1.3  # codes N(0, 64) x scale (1 + i/6) / 64
    assert kv_element_bytes(random_cache(model, PREFIX, CANVAS, torch.Generator())) == 2
    use_uniform_routing(model, max_tokens=64, seed=0)
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX, rounds=2)
    result = time_steps(model, cache, bench, "eager")
    assert result["rounds"] == 2 and result["median_ms"] > 0
    tokens = torch.randint(0, VOCAB, (CANVAS,), generator=torch.Generator().manual_seed(1))
    from dlmc.kv.gemma_round_attention import CanvasRoundAttention

    logits = model(tokens, torch.arange(PREFIX, PREFIX + CANVAS),
                   CanvasRoundAttention(cache, PREFIX), decoder=True)
    assert logits.shape == (CANVAS, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "fp8"}, f"--shape {SHAPE}: --precision fp8: expected one of bf16, nvfp4"),
    ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype int8: expected one of bf16, fp8"),
    ({"kv_layout": "paged"}, "--kv-layout paged: DiffusionGemma's cache is the dense static"),
    ({"temperature": 0.7}, "--temperature 0.7: the canvas step's temperature is its schedule"),
])
def test_option_problems_are_one_line_and_name_the_option(kwargs, message):
    options = {"precision": "nvfp4", "kv_cache_dtype": "fp8", "kv_layout": "auto",
               "temperature": 0.0, **kwargs}
    problem = canvas_option_problem(SHAPE, **options)
    assert problem is not None and message in problem and "\n" not in problem
    assert canvas_option_problem(SHAPE, "nvfp4", "fp8", "dense", 0.0) is None
    assert canvas_option_problem(SHAPE, "bf16", "bf16", "auto", 0.0) is None
