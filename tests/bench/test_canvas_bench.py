"""The pieces of `dlmc bench round --shape diffusiongemma-26b-a4b` on the CPU: uniform routing
(the model's router still runs), the experts each layer's routing touches, the bytes and matmul
FLOPs of a step (FLOPs against torch's counter on a tiny model; bytes at the full shape
against the checkpoint's tensor sizes), the floors, a timed eager step, and the profile's
kernel groups."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dlmc.bench.canvas_bench import (
    CanvasBenchConfig,
    UniformGemmaRouter,
    expert_counts,
    floors,
    group_of,
    profile_steps,
    profile_text,
    random_cache,
    step_bytes,
    step_flops,
    time_steps,
    use_uniform_routing,
)
from dlmc.errors import ConfigError
from dlmc.kv.gemma_round_attention import CanvasRoundAttention
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.shapes import DIFFUSIONGEMMA_26B_A4B
from tests.models.gemma_tiny import VOCAB, tiny_model

CANVAS, PREFIX = 8, 20  # the prefix is longer than the window (5)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    return tokens, torch.arange(PREFIX, PREFIX + CANVAS), torch.randn(CANVAS, VOCAB, generator=gen)


def test_uniform_routing_touches_its_experts_and_keeps_the_router_running():
    model = tiny_model(0)
    cache = random_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(0))
    tokens, positions, sc = _inputs(0)
    own = expert_counts(model, cache, tokens, positions, sc)
    assert len(own) == 6 and all(1 <= c <= 8 for c in own)
    use_uniform_routing(model, max_tokens=64, seed=0)
    routers = [layer.router for layer in model.model.decoder.layers]
    assert all(isinstance(r, UniformGemmaRouter) for r in routers)
    calls = []
    for r in routers:
        r.router.register_forward_hook(lambda *a: calls.append(1))
        # each token's experts are distinct; the weights sum to 1
        assert (r.ids.sort(-1).values.diff(dim=-1) > 0).all()
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(64))
    expected = [int(r.ids[:CANVAS].unique().numel()) for r in routers]
    assert expert_counts(model, cache, tokens, positions, sc) == expected
    assert len(calls) == 6
    # 64 tokens x top-2 of 8 experts touch every expert
    long = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(1))
    assert expert_counts(model, cache, long, torch.arange(PREFIX, PREFIX + 64), None) == [8] * 6


@torch.no_grad()
def test_step_flops_equal_torchs_count_of_the_forward():
    """A decoder forward with self-conditioning over a cache of PREFIX positions attended as a
    bucket of exactly PREFIX slots (sliding layers: the gathered window): every matmul counted
    (the fp32 experts run as gathered bmm, so torch counts them too)."""
    model = tiny_model(1)
    cache = random_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(1))
    tokens, positions, sc = _inputs(1)
    with FlopCounterMode(display=False) as counter:
        model(tokens, positions, CanvasRoundAttention(cache, PREFIX), decoder=True,
              self_conditioning_logits=sc)
    assert step_flops(model, CANVAS, PREFIX) == counter.get_total_flops() > 0


def test_step_bytes_and_flops_at_the_full_shape():
    """DiffusionGemma-26B-A4B in BF16 (built on the meta device), canvas 256, prefix 1024, every
    expert touched: the parts from the checkpoint's tensor shapes."""
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(DIFFUSIONGEMMA_26B_A4B).to(torch.bfloat16)
    parts = step_bytes(model, 256, 1024, [128] * 30)
    experts = 30 * 128 * (1408 * 2816 + 2816 * 704) * 2
    assert parts["experts"] == experts and round(experts / 1e9, 1) == 45.7
    embed = 262144 * 2816
    sliding = 2816 * (4096 + 2048 + 2048 + 4096) + 2 * 256
    full = 2816 * (8192 + 1024 + 8192) + 2 * 512
    per_layer = 3 * 2112 * 2816 + 128 * 2816 + 2816 + 128 + 7 * 2816 + 1  # + router, norms
    self_conditioning = 3 * 2112 * 2816 + 2816
    params = embed + 25 * sliding + 5 * full + 30 * per_layer + self_conditioning + 2816
    total_params = params + experts // 2
    assert abs(total_params / 1e9 - 25.2) < 0.1  # "25.2 B parameters in total"
    assert parts["weights"] == 2 * (params + embed + 256 * 2816)
    assert parts["kv"] == 2 * 2 * (25 * 1023 * 8 * 256 + 5 * 1024 * 2 * 512)  # K and V, bf16
    assert parts["vocab"] == 256 * 262144 * 20  # logits, noise, self-conditioning input
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    capped = step_bytes(model, 256, 1024, [128] * 30, capped_by_op=True)  # bf16 logits
    assert capped["vocab"] == 256 * 262144 * 16
    assert capped["total"] == parts["total"] - 256 * 262144 * 4
    # multiply-adds per canvas token: projections, dense MLPs, routers, self-conditioning MLP,
    # lm_head and softmax(sc) @ E, 8 experts per layer, q·k and p·v over the attended keys
    linear = (25 * 2816 * 12288 + 5 * 2816 * 17408 + 30 * (3 * 2112 + 128) * 2816
              + 3 * 2112 * 2816 + 2 * embed)
    experts_per_token = 30 * 8 * 3 * 2816 * 704
    # sliding layers read 1024 slots: the window's 1023 keys, aligned, one masked
    attention = 25 * 2 * 16 * 256 * (1024 + 256) + 5 * 2 * 16 * 512 * (1024 + 256)
    flops = step_flops(model, 256, 1024)
    assert flops == 2 * 256 * (linear + experts_per_token + attention)
    assert round(flops / 1e12, 2) == 2.53


def test_step_bytes_count_fused_weights_once_and_whole():
    """Fused projections (the per-projection weights views into one storage) touch the same
    bytes as the separate weights."""
    model = tiny_model(1)
    separate = step_bytes(model, CANVAS, PREFIX, [8] * 6)
    for module in model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    assert step_bytes(model, CANVAS, PREFIX, [8] * 6) == separate


def test_floors_name_the_binding_limit():
    got = floors(nbytes=50 * 10**9, flops=2 * 10**12, copy_gbps=4000.0, tensor_tflops=800.0)
    assert got["bandwidth_floor_ms"] == pytest.approx(12.5)
    assert got["compute_floor_ms"] == pytest.approx(2.5) and got["binds"] == "bandwidth"
    assert floors(10**9, 10**13, 4000.0, 800.0)["binds"] == "compute"


def test_time_steps_runs_steady_steps():
    model = tiny_model(2)
    use_uniform_routing(model, max_tokens=64, seed=0)
    cache = random_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(2))
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX, rounds=3)
    result = time_steps(model, cache, bench, "eager")
    assert result["mode"] == "eager" and result["rounds"] == 3
    assert 0 < result["min_ms"] <= result["median_ms"] <= result["max_ms"]
    assert result["key_len"] == PREFIX + CANVAS and int(cache.length) == PREFIX


@pytest.mark.parametrize(("name", "group"), [
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>",
     "matrix products"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNN", "matrix products"),
    ("aten::mm", "matrix products"),
    ("void at::cuda::detail::grouped_mm_kernel<...>", "routed experts"),
    ("_nvfp4_moe_gate_up_kernel", "routed experts"),
    ("_gate_up_kernel", "routed experts"),  # dlmc::bf16_moe's two kernels
    ("_down_kernel", "routed experts"),
    ("_gemma_canvas_attention_kernel", "attention"),
    ("triton_red_fused__softmax_exp_sum_0", "fused (Inductor)"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("aten::index_select", "other"),
])
def test_kernel_names_fall_in_their_group(name, group):
    assert group_of(name) == group


@torch.no_grad()
def test_eager_steps_profiled_by_group():
    model = tiny_model(0)
    cache = random_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(0))
    use_uniform_routing(model, max_tokens=64, seed=0)
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX, rounds=2)
    report = profile_steps(model, cache, bench, steps=2, mode="eager", top=5)
    assert report["device"] == "cpu" and report["steps"] == 2
    groups = report["groups_us"]
    assert report["step_us"] == pytest.approx(sum(groups.values()))
    assert report["step_us"] > 0 and all(us > 0 for us in groups.values())
    # the tiny model's dense layers and lm_head are matrix products
    assert groups.get("matrix products", 0) > 0
    assert len(report["kernels"]) == 5
    times = [k["us_per_step"] for k in report["kernels"]]
    assert times == sorted(times, reverse=True)
    assert all(k["group"] == group_of(k["name"]) for k in report["kernels"])
    text = profile_text(report)
    assert text.startswith("canvas step profile (eager, 2 steps, cpu)")
    assert all(group in text for group in groups)


def test_bad_arguments_name_them():
    model = tiny_model(0)
    cache = random_cache(model, PREFIX, CANVAS, torch.Generator().manual_seed(0))
    bench = CanvasBenchConfig(canvas=CANVAS, prefix=PREFIX)
    with pytest.raises(ConfigError, match="steps must be an integer >= 1, got 0"):
        profile_steps(model, cache, bench, steps=0)
    with pytest.raises(ConfigError, match="mode 'graph'"):
        profile_steps(model, cache, bench, mode="graph")
