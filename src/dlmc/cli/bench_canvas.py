"""`dlmc bench round --shape diffusiongemma-26b-a4b`: DiffusionGemma's denoising step eager,
compiled and graph-replayed at full size (random weights on the GPU; routed experts in BF16 or
NVFP4, the prefix cache in BF16 or FP8), with bytes touched, GB/s, the copy bandwidth of the
same run, FLOPs and both floors; with `loop`, a whole graph-mode decode's host overhead
(`dlmc.bench.canvas_loop`)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any


def canvas_round(shape: str, canvas: int, prefix: int, routing: str, rounds: int,
                 modes: tuple[str, ...], kernels: Any, out: Path | None,
                 precision: str = "bf16", kv_cache_dtype: str = "bf16",
                 loop: bool = False, profile: bool = False) -> dict[str, Any]:
    """Build the shape on the GPU (BF16, routed experts in `precision`, the prefix cache in
    `kv_cache_dtype`), time `rounds` steady steps per mode (and with `loop` a whole decode
    against its passes; with `profile` the device time of compiled steps by kernel group),
    print a table and write the JSON report to `out`."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from dlmc.bench.canvas_bench import (
        CanvasBenchConfig,
        expert_counts,
        floors,
        random_cache,
        step_bytes,
        step_flops,
        time_steps,
        use_uniform_routing,
    )
    from dlmc.bench.canvas_loop import canvas_loop_overhead, loop_line, max_pass_tokens
    from dlmc.bench.canvas_precision import (
        build_canvas_model,
        fp8_bench_scales,
        kv_element_bytes,
        random_fp8_cache,
    )
    from dlmc.bench.timing import copy_bandwidth_gbps
    from dlmc.models.shapes import SHAPES

    device = torch.device("cuda")
    console = Console()
    started = time.perf_counter()
    bench = CanvasBenchConfig(canvas, prefix, routing, rounds, modes, kernels=kernels)
    model = build_canvas_model(SHAPES[shape], device, precision, kernels, seed=bench.seed)
    console.print(f"built {shape} ({precision} experts) in {time.perf_counter() - started:.1f} s",
                  highlight=False)
    torch.cuda.empty_cache()
    if routing == "uniform":
        # routes for every forward of a decode (the loop's encoder chunks are longer)
        use_uniform_routing(model, max_tokens=max_pass_tokens(canvas), seed=bench.seed)
    gen = torch.Generator(device=device).manual_seed(1)
    make_cache = random_fp8_cache if kv_cache_dtype == "fp8" else random_cache
    cache = make_cache(model, prefix, canvas, gen)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (canvas,), device=device, generator=gen)
    sc = torch.randn(canvas, vocab, device=device, generator=gen).to(torch.bfloat16)
    counts = expert_counts(model, cache, tokens, torch.arange(prefix, prefix + canvas,
                                                              device=device), sc)
    parts = step_bytes(model, canvas, prefix, counts, kv_bytes=kv_element_bytes(cache),
                       capped_by_op=bench.kernels.triton_gemma_sampler(cache.device.type))
    nbytes, flops = parts["total"], step_flops(model, canvas, prefix)
    bandwidth = copy_bandwidth_gbps()
    limits = floors(nbytes, flops, bandwidth, bench.tensor_tflops)
    results = []
    for mode in bench.modes:  # a line per mode as it ends: a cold compile takes minutes
        results.append(time_steps(model, cache, bench, mode))
        console.print(f"{mode}: warm-up {results[-1]['warmup_s']:.1f} s (compile and capture "
                      f"{results[-1]['compile_capture_s']:.1f} s), median "
                      f"{results[-1]['median_ms']:.3f} ms", highlight=False)
    for r in results:
        r["gb_per_s"] = nbytes / r["median_ms"] / 1e6
        r["fraction_of_copy_bw"] = r["gb_per_s"] / bandwidth
        r["tflop_per_s"] = flops / r["median_ms"] / 1e9
        if "queued_median_ms" in r:
            r["queued_fraction_of_copy_bw"] = nbytes / r["queued_median_ms"] / 1e6 / bandwidth
    report = {"shape": shape, "precision": precision, "kv_cache_dtype": kv_cache_dtype,
              "canvas": canvas,
              "prefix": prefix, "routing": routing, "kernels": kernels.to_dict(),
              "bytes_per_step": nbytes, "bytes_by_part": parts,
              "distinct_experts_per_moe_layer": sum(counts) / len(counts),
              "min_distinct_experts": min(counts), "flops_per_step": flops,
              "copy_gb_per_s": bandwidth, "tensor_tflop_per_s": bench.tensor_tflops, **limits,
              "results": results, "loop": None, "profile": None,
              "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version()}
    table = Table(title=f"{shape} denoising step · {precision} experts · {kv_cache_dtype} KV · "
                  f"canvas {canvas} · prefix {prefix} · "
                  f"{routing} routing · {report['distinct_experts_per_moe_layer']:.0f} experts/"
                  f"layer · {flops / 1e12:.2f} TFLOP · floors: bandwidth "
                  f"{limits['bandwidth_floor_ms']:.2f} ms, compute "
                  f"{limits['compute_floor_ms']:.2f} ms ({limits['binds']} binds) · kernels: "
                  f"{kernels.describe()}")
    for col in ("mode", "median ms", "min–max ms", "GB touched", "GB/s", "copy GB/s", "ratio",
                "TFLOP/s"):
        table.add_column(col, justify="right")
    rows = [(r["mode"], r["median_ms"], r["min_ms"], r["max_ms"]) for r in results]
    rows += [("graph, queued", r["queued_median_ms"], r["queued_min_ms"], r["queued_max_ms"])
             for r in results if "queued_median_ms" in r]
    for name, median, low, high in rows:
        gbps = nbytes / median / 1e6
        table.add_row(name, f"{median:.3f}", f"{low:.3f}–{high:.3f}", f"{nbytes / 1e9:.2f}",
                      f"{gbps:.0f}", f"{bandwidth:.0f}", f"{gbps / bandwidth:.1%}",
                      f"{flops / median / 1e9:.0f}")
    console.print(table)
    _write(report, out)  # the steps' figures, kept if the loop fails
    if profile:
        from dlmc.bench.canvas_bench import profile_steps, profile_text

        report["profile"] = profile_steps(model, cache, bench)
        console.print(profile_text(report["profile"]), markup=False, highlight=False)
        _write(report, out)
    if loop:  # a whole graph-mode decode of the pinned canvases and steps
        del cache
        torch.cuda.empty_cache()
        scales = (fp8_bench_scales(model.config.num_hidden_layers)
                  if kv_cache_dtype == "fp8" else None)
        report["loop"] = canvas_loop_overhead(model, bench, mode="graph", fp8_scales=scales)
        console.print(loop_line(report["loop"]), soft_wrap=True, markup=False, highlight=False)
        _write(report, out)
    return report


def _write(report: dict[str, Any], out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
