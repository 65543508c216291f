"""`dlmc bench round --shape diffusiongemma-26b-a4b`: time DiffusionGemma's denoising step (the
decoder forward over the canvas + sampler + acceptance + re-noise + the next self-conditioning
input) eager, compiled and graph-replayed, with the bytes the actual routing touched, the
matmul FLOPs, and the step's two floors: bytes at the copy bandwidth measured in the same run,
FLOPs at the tensor cores' peak; with `--profile`, where a step's device time goes.

What a steady step (with self-conditioning) touches, in bytes:
- weights: every non-expert weight once, the embedding table twice (the tied lm_head and the
  self-conditioning `softmax @ E`) plus the canvas's embedding rows, and each MoE layer's
  distinct routed experts (from one forward's routing: 256 tokens x top-8 of 128 touch all);
- KV: full layers' K and V of the whole prefix, sliding layers' of its last `window - 1`
  positions (the canvas's own K/V are computed, not read);
- the `[C, V]` tensors the step must move: the logits written and read back (fp32 when torch
  ops cap them; the lm_head's output dtype when `dlmc::canvas_propose` caps them as it reads
  them), the fp32 Exp(1) noise written and read, the self-conditioning logits read and
  written.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlmc.bench.timing import cuda_times, queued_cuda_times
from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_runner import CanvasRunner
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_round_attention import CanvasRoundAttention, canvas_past_slots
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion, GemmaDecoderLayer
from dlmc.models.diffusion_gemma_moe import GemmaRouter

BF16_TENSOR_TFLOPS = 790.0  # dense bf16 matrix products on an H200 (docs: performance)


@dataclass(frozen=True)
class CanvasBenchConfig:
    canvas: int = 256
    prefix: int = 1024
    routing: str = "uniform"  # "uniform" | "model"
    rounds: int = 100
    modes: tuple[str, ...] = ("eager", "compile", "graph")
    seed: int = 0
    kernels: KernelConfig = DEFAULT_KERNELS
    tensor_tflops: float = BF16_TENSOR_TFLOPS  # the compute floor's rate


class UniformGemmaRouter(nn.Module):
    """Uniform routing: each token draws top-k distinct experts uniformly (seeded, fixed), with
    weights summing to 1. The model's router still runs every step: its weights enter as
    `0 * w` (0 * x is not 0 for inf/NaN, so no compiler drops the router's work)."""

    def __init__(self, router: GemmaRouter, num_experts: int, max_tokens: int,
                 gen: torch.Generator) -> None:
        super().__init__()
        self.router = router
        device = router.proj.weight.device
        keys = torch.rand(max_tokens, num_experts, device=device, generator=gen)
        self.register_buffer("ids", keys.topk(router.top_k, dim=-1).indices)  # [T, K]
        weights = torch.rand(max_tokens, router.top_k, device=device, generator=gen)
        self.register_buffer("weights", weights / weights.sum(-1, keepdim=True))  # [T, K]

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        real = self.router(h)[1]  # [T, K]
        tokens = h.shape[0]
        if tokens > self.ids.shape[0]:
            raise ConfigError(f"uniform routing: a forward of {tokens} tokens, but routes were "
                              f"drawn for {self.ids.shape[0]} (raise use_uniform_routing's "
                              "max_tokens)")
        return self.ids[:tokens], self.weights[:tokens] + 0.0 * real[:1, :1]


def use_uniform_routing(model: DiffusionGemmaForBlockDiffusion, max_tokens: int,
                        seed: int) -> None:
    """Every layer's router becomes a `UniformGemmaRouter` (which keeps the real one running)."""
    cfg = model.config
    gen = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    for layer in model.model.decoder.layers:
        layer.router = UniformGemmaRouter(layer.router, cfg.num_experts, max_tokens, gen)


def _layers(model: nn.Module) -> list[GemmaDecoderLayer]:
    return [m for m in model.modules() if isinstance(m, GemmaDecoderLayer)]


def expert_counts(model: DiffusionGemmaForBlockDiffusion, cache: GemmaStaticCache,
                  tokens: torch.Tensor, positions: torch.Tensor,
                  sc_logits: torch.Tensor | None) -> list[int]:
    """Distinct experts each layer's experts module gets in one decoder forward of `tokens`
    at `positions` over `cache` (whichever router made the ids)."""
    counts: list[int] = []
    hooks = [layer.experts.register_forward_pre_hook(
        lambda _m, args: counts.append(int(args[1].unique().numel()))) for layer in _layers(model)]
    key_len = max(int(cache.length), 1)
    try:
        with torch.inference_mode():
            model(tokens, positions, CanvasRoundAttention(cache, key_len), decoder=True,
                  self_conditioning_logits=sc_logits)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def step_bytes(model: DiffusionGemmaForBlockDiffusion, canvas: int, prefix: int,
               experts_per_layer: list[int], kv_bytes: int | None = None,
               capped_by_op: bool = False) -> dict[str, int]:
    """Bytes one steady step touches (module docstring), by part, and their sum `total`; each
    expert at its stored size (NVFP4: codes and scales), K/V at `kv_bytes` per element (1 for
    an FP8 cache; default: the embedding's element size); the logits in fp32, or with
    `capped_by_op` (`dlmc::canvas_propose` caps them) in the lm_head's dtype."""
    cfg = model.config
    table = model.lm_head_weight
    weights = 0
    seen: set[int] = set()  # tied, shared or fused storages count once, whole
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(tensor)  # (meta tensors: no address)
        if ".experts." in name or key in seen:
            continue
        seen.add(key)
        weights += (storage.nbytes() if storage.data_ptr() else
                    tensor.numel() * tensor.element_size())
    row = table.shape[1] * table.element_size()
    weights += table.numel() * table.element_size() + canvas * row  # the 2nd pass, the rows
    experts = 0
    for layer, count in zip(_layers(model), experts_per_layer, strict=True):
        tensors = [*layer.experts.parameters(), *layer.experts.buffers()]
        experts += count * sum(t[0].numel() * t.element_size() for t in tensors)
    kv = 0
    for i in range(cfg.num_hidden_layers):
        window = cfg.layer_window(i)
        keys = prefix if window is None else min(prefix, window - 1)
        kv += 2 * keys * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * (
            kv_bytes or table.element_size())
    logits = table.element_size() if capped_by_op else 4
    vocab = canvas * cfg.vocab_size * (2 * logits + 2 * 4 + 2 * table.element_size())
    total = weights + experts + kv + vocab
    return {"weights": weights, "experts": experts, "kv": kv, "vocab": vocab, "total": total}


def step_flops(model: DiffusionGemmaForBlockDiffusion, canvas: int, prefix: int) -> int:
    """Matmul FLOPs of one steady step: 2 per multiply-add of every linear layer (the experts
    for canvas x top-k pairs), of the lm_head and the self-conditioning `softmax @ E`, and of
    attention's q·k and p·v over the keys each layer reads (the window's masked slots too)."""
    cfg = model.config
    linear = 0
    for name, tensor in model.named_parameters():
        if tensor.dim() == 2 and ".experts." not in name and "embed_tokens" not in name:
            linear += tensor.numel()
    linear += 2 * model.lm_head_weight.numel()  # the lm_head and softmax(sc) @ E
    pair = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up, down of one expert
    experts = cfg.num_hidden_layers * cfg.top_k_experts * pair
    attention = 0
    for i in range(cfg.num_hidden_layers):
        keys = canvas_past_slots(cfg.layer_window(i), prefix) + canvas
        attention += 2 * cfg.num_attention_heads * cfg.layer_head_dim(i) * keys
    return 2 * canvas * (linear + experts + attention)


def floors(nbytes: int, flops: int, copy_gbps: float, tensor_tflops: float) -> dict[str, Any]:
    """The step's lower bounds in ms: bytes at the copy bandwidth, FLOPs at the tensor-core
    rate; `binds`: the larger one's name."""
    bandwidth_ms = nbytes / (copy_gbps * 1e9) * 1e3
    compute_ms = flops / (tensor_tflops * 1e12) * 1e3
    return {"bandwidth_floor_ms": bandwidth_ms, "compute_floor_ms": compute_ms,
            "binds": "bandwidth" if bandwidth_ms >= compute_ms else "compute"}


def _steady_runner(model: DiffusionGemmaForBlockDiffusion, cache: GemmaStaticCache,
                   bench: CanvasBenchConfig, mode: str) -> CanvasRunner:
    """A canvas runner in `mode` past its canvas's first step (no self-conditioning; run
    eagerly, as only steady steps are timed: one compile instead of two) and three steady ones
    (compiled and captured), synchronised."""
    runner = CanvasRunner(model, cache, CanvasSettings(canvas_length=bench.canvas), mode,
                          bench.kernels)
    torch.manual_seed(bench.seed)
    runner.start_canvas()
    runner.step(eager=True)
    for _ in range(3):
        runner.step()
    if cache.device.type == "cuda":
        torch.cuda.synchronize()
    return runner


def time_steps(model: DiffusionGemmaForBlockDiffusion, cache: GemmaStaticCache,
               bench: CanvasBenchConfig, mode: str) -> dict[str, Any]:
    """Median / min / max ms of `bench.rounds` steady steps in `mode` (after the canvas's
    first step and warm-up) over `cache` holding `bench.prefix` positions."""
    started = time.perf_counter()
    runner = _steady_runner(model, cache, bench, mode)
    warmup_s = time.perf_counter() - started
    times = cuda_times(runner.step, bench.rounds)
    result = {"mode": mode, "median_ms": statistics.median(times), "min_ms": min(times),
              "max_ms": max(times), "warmup_s": warmup_s, "compile_capture_s": runner.compile_s,
              "key_len": runner.key_len(runner.length), "rounds": bench.rounds}
    if mode == "graph":  # the replays alone, queued back to back: the device's time per step
        queued = queued_cuda_times(runner.launch, bench.rounds)
        result.update(queued_median_ms=statistics.median(queued), queued_min_ms=min(queued),
                      queued_max_ms=max(queued))
    return result


def random_cache(model: DiffusionGemmaForBlockDiffusion, prefix: int, canvas: int,
                 gen: torch.Generator) -> GemmaStaticCache:
    """A cache of `prefix` random (never zero) positions, room for the canvas after them."""
    device = model.lm_head_weight.device
    cache = GemmaStaticCache(model.config, prefix + canvas, model.lm_head_weight.dtype, device)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, device=device, generator=gen))
    cache.length.fill_(prefix)
    return cache


# Where a step's time goes (`--profile`): steady steps of the compiled (not graph-captured)
# runner under torch.profiler; each kernel's self time (CUDA kernels on a GPU, operators' self
# CPU time on the CPU) falls in one group by its name; the groups sum to the profiled time.
# (group, pattern over a kernel's or operator's name, lower case); the first match wins
GROUPS: tuple[tuple[str, str], ...] = (
    ("routed experts", r"grouped_mm|grouped_gemm|nvfp4|moe|gluon|^_gate_up_kernel|"
                       r"^_down_kernel"),
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
    runner = _steady_runner(model, cache, bench, mode)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.step()
        if cuda:
            torch.cuda.synchronize()
    kernels = []  # (µs per step, calls per step, name, group); key_averages: one row per name
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (cuda or not event.key.startswith("ProfilerStep")):
            kernels.append((us / steps, event.count / steps, event.key, group_of(event.key)))
    kernels.sort(key=lambda kernel: -kernel[0])
    groups: dict[str, float] = {}
    for us, _, _, group in kernels:
        groups[group] = groups.get(group, 0.0) + us
    return {"mode": mode, "steps": steps, "device": "cuda" if cuda else "cpu",
            "step_us": sum(groups.values()),
            "groups_us": dict(sorted(groups.items(), key=lambda item: -item[1])),
            "kernels": [{"name": name, "group": group, "us_per_step": us,
                         "calls_per_step": calls} for us, calls, name, group in kernels[:top]]}


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
