"""`dlmc bench round`: eager vs compiled vs CUDA-graph rounds at full model shapes."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import click

from dlmc.cli.options import kernel_options, user_errors


@click.command("round", short_help="Time one denoising round on a CUDA GPU: eager, compiled, "
               "CUDA graph.")
@click.option("--model", default=None, help="Checkpoint (else --shape with random weights).")
@click.option("--shape", default="llada2.1-mini", show_default=True,
              help="Full-size shape built on the GPU with random seeded weights: llada2.1-mini "
              "or diffusiongemma-26b-a4b (its denoising step over a canvas).")
@click.option("--precision", type=click.Choice(["bf16", "nvfp4"]), default="bf16",
              show_default=True)
@click.option("--block-length", type=int, default=32, show_default=True)
@click.option("--canvas", type=int, default=256, show_default=True,
              help="DiffusionGemma: the canvas length of the timed step.")
@click.option("--prefix", type=int, default=1024, show_default=True,
              help="Tokens already in the KV cache.")
@click.option("--routing", type=click.Choice(["uniform", "model"]), default="uniform",
              show_default=True, help="uniform: top-k distinct experts drawn uniformly.")
@click.option("--rounds", type=int, default=100, show_default=True)
@click.option("--modes", default="eager,compile,graph", show_default=True)
@click.option("--loop/--no-loop", default=True, help="Also measure a whole graph-mode decode's "
              "host overhead (DiffusionGemma: 2 canvases of 16 steps after a --prefix prompt).")
@click.option("--kv-cache-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16",
              show_default=True, help="K/V precision (fp8: E4M3 with per-layer scales in the "
              "paged cache; DiffusionGemma: in its static cache).")
@click.option("--kv-layout", type=click.Choice(["auto", "dense", "paged"]), default="auto",
              show_default=True, help="auto: paged (Triton attention over the live prefix); "
              "dense: static cache attended up to a power-of-two key-length bucket.")
@click.option("--profile", is_flag=True, help="Per-kernel breakdown (torch.profiler).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="> 0: time sampled rounds (seeded) instead of greedy ones (the profile "
              "and the loop stay greedy).")
@click.option("--fuse-shared-expert/--no-fuse-shared-expert", default=True, show_default=True,
              help="Run each MoE layer's shared expert inside the routed grouped kernels "
              "(one more expert, weight 1.0 for every token), as LLM does on CUDA; with NVFP4 "
              "experts in BF16 inside the NVFP4 op's launches.")
@click.option("--fuse-gate-up/--no-fuse-gate-up", default=True, show_default=True,
              help="One GEMM for the gate and up projections of every dense SwiGLU MLP (the "
              "dense layer, unfused shared experts), as LLM does on CUDA.")
@kernel_options
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
@user_errors
def round_cmd(model: str | None, shape: str, precision: str, block_length: int, canvas: int,
              prefix: int, routing: str, rounds: int, modes: str, loop: bool, kv_cache_dtype: str,
              kv_layout: str, profile: bool, temperature: float, fuse_shared_expert: bool,
              fuse_gate_up: bool, kernels: Any, out: Path | None) -> None:
    """Median ms per round with bytes touched, GB/s and the copy bandwidth of the same run.

    Needs a CUDA GPU: the model is built at full size with random seeded weights on it (or
    loaded with --model), and rounds are timed with CUDA events."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from dlmc.bench.round_bench import (
        RoundBenchConfig,
        loop_overhead,
        profile_rounds,
        time_rounds,
        touched_bytes,
        use_uniform_routing,
    )
    from dlmc.errors import ConfigError

    canvas_shape = model is None and shape.startswith("diffusiongemma")
    problem = _option_problem(model, shape, canvas_shape, modes, rounds, prefix, block_length,
                              canvas)
    if canvas_shape and not problem:
        from dlmc.bench.canvas_precision import canvas_option_problem

        problem = canvas_option_problem(shape, precision, kv_cache_dtype, kv_layout,
                                        temperature)
    if problem:  # before the GPU check and before minutes of building the model
        raise ConfigError(problem)
    if not torch.cuda.is_available():
        raise ConfigError("dlmc bench round needs a CUDA GPU")
    if canvas_shape:
        from dlmc.cli.bench_canvas import canvas_round

        canvas_round(shape, canvas, prefix, routing, rounds, tuple(modes.split(",")), kernels,
                     out, precision=precision, kv_cache_dtype=kv_cache_dtype, loop=loop,
                     profile=profile)
        return
    device = torch.device("cuda")
    cfg = RoundBenchConfig(block_length, prefix, routing, rounds, tuple(modes.split(",")),
                           temperature=temperature, kernels=kernels)
    net = _build(model, shape, device, precision, kernels)
    fused_layers = 0
    if fuse_shared_expert:
        from dlmc.models.moe import fuse_shared_experts

        fused_layers = fuse_shared_experts(net)
        torch.cuda.empty_cache()
    if fuse_gate_up:
        from dlmc.models.layers import fuse_gate_up_projections

        fuse_gate_up_projections(net)
    mask_id = net.config.vocab_size - 1
    if routing == "uniform":
        use_uniform_routing(net, max_tokens=512, seed=cfg.seed)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, mask_id, (block_length,), device=device, generator=gen)
    positions = torch.arange(prefix, prefix + block_length, device=device)
    nbytes, experts = touched_bytes(net, tokens, positions, prefix,
                                    kv_bytes=1 if kv_cache_dtype == "fp8" else 2)
    from dlmc.bench.timing import copy_bandwidth_gbps

    bandwidth = copy_bandwidth_gbps()
    c = net.config
    from dlmc.kv.layout import uses_paged_cache

    paged = uses_paged_cache(kv_layout, kv_cache_dtype, device, torch.bfloat16, "graph")
    cache = _cache(c, prefix, block_length, kv_cache_dtype, paged, device, gen,
                   kernels.attention_backend)
    results = [time_rounds(net, cache, cfg, mode, mask_id) for mode in cfg.modes]
    def gb_per_s(ms: float) -> float:
        return nbytes / ms / 1e6

    for r in results:
        r["gb_per_s"] = gb_per_s(r["median_ms"])
        r["fraction_of_copy_bw"] = r["gb_per_s"] / bandwidth
        if "queued_median_ms" in r:  # graph replays queued back to back
            r["queued_fraction_of_copy_bw"] = gb_per_s(r["queued_median_ms"]) / bandwidth
        if "in_flight_median_ms" in r:  # the decode loop's pattern: a round in flight
            r["in_flight_fraction_of_copy_bw"] = gb_per_s(r["in_flight_median_ms"]) / bandwidth
    graph = [r for r in results if r["mode"] == "graph"]
    # The whole-decode loop, once per refresh mode (a finished block's K/V rewritten inside
    # the next block's first round, or by a forward of its own): same prompt, same run.
    def loop_round_ms(lookahead: bool) -> float:  # the round time of the loop's pattern
        r = graph[0]
        return r.get("in_flight_median_ms", r["median_ms"]) if lookahead else r["median_ms"]

    overhead = ([loop_overhead(net, cfg, mask_id, loop_round_ms(lookahead),
                               kv_cache_dtype=kv_cache_dtype, refresh=refresh,
                               kv_layout="paged" if paged else "dense", lookahead=lookahead)
                 for refresh, lookahead in (("fused", True), ("fused", False),
                                            ("separate", True))]
                if loop and graph else None)
    report = {"shape": model or shape, "precision": precision, "kv_cache_dtype": kv_cache_dtype,
              "kv_layout": "paged" if paged else "dense",
              "block_length": block_length,
              "prefix": prefix, "routing": routing, "temperature": temperature,
              "fused_shared_expert_layers": fused_layers,
              "fused_gate_up": fuse_gate_up,
              "kernels": kernels.to_dict(),
              "bytes_per_round": nbytes,
              "distinct_experts_per_moe_layer": experts, "copy_gb_per_s": bandwidth,
              "floor_ms": nbytes / (bandwidth * 1e9) * 1e3, "results": results,
              "loop": overhead, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": _triton_version(), "python": platform.python_version()}
    table = Table(title=f"{report['shape']} round · {precision} · {kv_cache_dtype} "
                  f"{report['kv_layout']} KV · block {block_length} · "
                  f"prefix {prefix} · {routing} routing · {experts:.0f} experts/layer"
                  + (f" · shared expert fused in {fused_layers} layers" if fuse_shared_expert
                     else "") + (f" · sampled, temperature {temperature}" if temperature else "")
                  + f" · kernels: {kernels.describe()}")
    for col in ("mode", "median ms", "min–max ms", "GB touched", "GB/s", "copy GB/s", "ratio"):
        table.add_column(col, justify="right")
    rows = [(r["mode"], r["median_ms"], r["min_ms"], r["max_ms"]) for r in results]
    # graph replays queued back to back (no "done" read between them): the device's own time
    rows += [("graph, queued", r["queued_median_ms"], r["queued_min_ms"], r["queued_max_ms"])
             for r in graph if "queued_median_ms" in r]
    # the decode loop's pattern: the next round queued before the host reads the last's flag
    rows += [("graph, in flight", r["in_flight_median_ms"], r["in_flight_min_ms"],
              r["in_flight_max_ms"]) for r in graph if "in_flight_median_ms" in r]
    for name, median, low, high in rows:
        table.add_row(name, f"{median:.3f}", f"{low:.3f}–{high:.3f}", f"{nbytes / 1e9:.2f}",
                      f"{gb_per_s(median):.0f}", f"{bandwidth:.0f}",
                      f"{gb_per_s(median) / bandwidth:.1%}")
    console = Console()
    console.print(table)
    for o in overhead or ():
        console.print(f"loop ({o['refresh']} refresh, lookahead {o['lookahead']}): "
                      f"wall {o['wall_ms']:.1f} ms for "
                      f"{o['rounds']} rounds at {o['round_ms']:.3f} ms ({o['fused_rounds']} "
                      f"fused, {o['fused_round_ms_median']:.3f} ms each) + "
                      f"{o['prefill_chunks']} prefill chunks of {o['prefill_chunk_tokens']} "
                      f"tokens ({o['prefill_ms_median']:.3f} ms each) + {o['fill_forwards']} "
                      f"refreshes ({o['fill_ms_median']:.3f} ms each); host overhead "
                      f"{o['overhead_ratio']:.1%}")
    if profile:
        report["profile"] = profile_rounds(net, cache, cfg, mask_id)
        console.print(report["profile"], markup=False, highlight=False)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))


def _option_problem(model: str | None, shape: str, canvas_shape: bool, modes: str,
                    rounds: int, prefix: int, block_length: int, canvas: int) -> str | None:
    """Why these options cannot be timed (one line naming the option), or None. An option
    given on the command line that the chosen model does not take is refused too."""
    from click.core import ParameterSource

    from dlmc.graphs.runner import MODES
    from dlmc.models.shapes import SHAPES

    if model is None and shape not in SHAPES:
        return f"--shape {shape!r}: expected one of {', '.join(SHAPES)}"
    if not modes or any(m not in MODES for m in modes.split(",")):
        return f"--modes {modes!r}: expected a comma-separated list of {', '.join(MODES)}"
    for name, value, least in (("--rounds", rounds, 1), ("--prefix", prefix, 0),
                               ("--block-length", block_length, 1), ("--canvas", canvas, 1)):
        if value < least:
            return f"{name} {value}: expected an integer >= {least}"
    given = click.get_current_context().get_parameter_source
    foreign = (("block_length", "fuse_shared_expert", "fuse_gate_up") if canvas_shape
               else ("canvas",))
    for name in foreign:
        if given(name) == ParameterSource.COMMANDLINE:
            option = "--" + name.replace("_", "-")
            return (f"{option}: not an option of {shape if canvas_shape else 'LLaDA2'}'s round"
                    + (" (its canvas is --canvas)" if name == "block_length" else ""))
    return None


def _build(model: str | None, shape: str, device: Any, precision: str, kernels: Any) -> Any:
    import torch

    from dlmc.errors import ConfigError
    from dlmc.models.nvfp4_experts import apply_kernel_config
    from dlmc.models.shapes import SHAPES, build_random_model, use_random_nvfp4_experts

    if model:
        from dlmc.api import LLM
        from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig

        llm = LLM(model, device=device, dtype="bf16", mode="eager", precision=precision,
                  kernels=kernels)
        if isinstance(llm.config, DiffusionGemmaConfig):
            raise ConfigError(f"--model {model}: a DiffusionGemma checkpoint; its denoising step "
                              "is timed at full size with --shape diffusiongemma-26b-a4b")
        return llm.model
    net = build_random_model(SHAPES[shape], device, torch.bfloat16, seed=0)
    if precision == "nvfp4":
        use_random_nvfp4_experts(net, seed=0)
        torch.cuda.empty_cache()
    apply_kernel_config(net, kernels)
    return net


def _cache(c: Any, prefix: int, block_length: int, kv_cache_dtype: str, paged: bool,
           device: Any, gen: Any, backend: str) -> Any:
    """A KV cache holding `prefix` random (never zero) tokens."""
    import torch

    from dlmc.kv.dense_cache import DenseKVCache
    from dlmc.kv.paged_cache import KVCacheConfig, PagedKVCache

    size = prefix + block_length + 1024
    if paged:
        cache = PagedKVCache(KVCacheConfig(c.num_hidden_layers, c.num_key_value_heads,
                                           c.head_dim, size, dtype=kv_cache_dtype), device,
                             backend=backend)
        for pool in (*cache.k, *cache.v):
            pool.copy_(torch.randn(pool.shape, device=device, generator=gen).to(pool.dtype))
        cache.advance(prefix)
        return cache
    cache = DenseKVCache(c.num_hidden_layers, size, c.num_key_value_heads, c.head_dim,
                         torch.bfloat16, device)
    for pool in (*cache.k, *cache.v):
        pool.normal_(generator=gen)
    return cache


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"
