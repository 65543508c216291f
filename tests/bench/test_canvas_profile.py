"""`dlmc bench round --shape diffusiongemma-26b-a4b --profile` on the CPU: eager steps of the
tiny model profiled; the groups hold every profiled operator and sum to the step's time."""

from __future__ import annotations

import pytest
import torch

from dlmc.bench.canvas_bench import CanvasBenchConfig, random_cache, use_uniform_routing
from dlmc.bench.canvas_profile import group_of, profile_steps, profile_text
from dlmc.errors import ConfigError
from tests.models.gemma_tiny import tiny_model

CANVAS, PREFIX = 8, 20


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
