"""`dlmc bench round --shape diffusiongemma-26b-a4b --profile`: where a denoising step's device
time goes.

Steady steps of the compiled (not graph-captured) canvas runner run under torch.profiler. Each
kernel's self time (CUDA kernels on a GPU, operators' self CPU time on the CPU) falls in one
group by its name: the routed experts' grouped GEMMs, other matrix products, attention, the
step's `[C, V]` work (soft-cap, softmax, entropy, sampling: Inductor's kernels over the vocab
rows are told apart by their size only on the GPU, so they count as fused kernels), Inductor's
other fused kernels, copies and the rest. The groups sum to the profiled time.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dlmc.bench.canvas_bench import CanvasBenchConfig
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_runner import CanvasRunner
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

__all__ = ["GROUPS", "group_of", "profile_steps", "profile_text"]

# (group, pattern over a kernel's or operator's name, lower case); the first match wins
GROUPS: tuple[tuple[str, str], ...] = (
    ("routed experts", r"grouped_mm|grouped_gemm|nvfp4|moe|gluon|^_gate_up_kernel|^_down_kernel"),
    ("attention", r"attention|flash|fmha|sdpa"),
    ("matrix products", r"gemm|nvjet|cutlass|xmma|cublas|aten::mm|aten::addmm|aten::bmm|"
                        r"aten::matmul|aten::linear|splitk|split_k"),
    ("fused (Inductor)", r"^triton_|cpp_fused|^void at::native::.*reduce|aten::softmax|"
                         r"aten::_softmax|aten::exp|aten::log|aten::tanh"),
    ("copies", r"memcpy|memset|copy_|aten::copy|aten::_to_copy|aten::to|aten::clone|"
               r"aten::fill|aten::zero"),
)


def group_of(name: str) -> str:
    """The group of a kernel or operator named `name` ("other" when no pattern matches)."""
    low = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def profile_steps(model: DiffusionGemmaForBlockDiffusion, cache: GemmaStaticCache,
                  bench: CanvasBenchConfig, steps: int = 5, mode: str = "compile",
                  top: int = 25) -> dict[str, Any]:
    """Profile `steps` steady steps in `mode` ("compile", or "eager"): per group and per kernel
    (the `top` longest), the self device time per step in µs, with call counts per step."""
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"canvas profile: steps must be an integer >= 1, got {steps!r}")
    if mode not in ("compile", "eager"):
        raise ConfigError(f"canvas profile: mode {mode!r}: expected 'compile' or 'eager' (a "
                          "replayed graph hides its kernels from the profiler)")
    from torch.profiler import ProfilerActivity, profile

    cuda = cache.device.type == "cuda"
    runner = CanvasRunner(model, cache, CanvasSettings(canvas_length=bench.canvas), mode,
                          bench.kernels)
    torch.manual_seed(bench.seed)
    runner.start_canvas()
    for _ in range(3):  # the first step (no self-conditioning), then steady ones
        runner.step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.step()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or (not cuda and event.key.startswith("ProfilerStep")):
            continue
        entry = kernels.setdefault(event.key, [0.0, 0.0])
        entry[0] += us / steps
        entry[1] += event.count / steps
    groups: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    return {"mode": mode, "steps": steps, "device": "cuda" if cuda else "cpu",
            "step_us": sum(groups.values()),
            "groups_us": dict(sorted(groups.items(), key=lambda item: -item[1])),
            "kernels": [{"name": name, "group": group_of(name), "us_per_step": us,
                         "calls_per_step": calls} for name, (us, calls) in ranked[:top]]}


def profile_text(report: dict[str, Any]) -> str:
    """The profile as lines: the groups with their share of the step, then the longest
    kernels."""
    total = report["step_us"] or 1.0
    lines = [f"canvas step profile ({report['mode']}, {report['steps']} steps, "
             f"{report['device']}): {report['step_us'] / 1e3:.3f} ms of kernels per step"]
    lines += [f"  {group:<18} {us / 1e3:8.3f} ms  {us / total:6.1%}"
              for group, us in report["groups_us"].items()]
    lines.append("  longest kernels (µs per step, calls per step, group):")
    lines += [f"  {k['us_per_step']:9.1f}  {k['calls_per_step']:6.1f}  {k['group']:<18} "
              f"{k['name'][:90]}" for k in report["kernels"]]
    return "\n".join(lines)
