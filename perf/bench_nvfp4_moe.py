"""Benchmark `dlmc::nvfp4_moe` at LLaDA2.1-mini expert shapes against the device copy bandwidth.

Default: H=2048, I=512, E=256, top-8, 32 tokens (one diffusion block), uniform random routing with
distinct experts per token, 19 layers of distinct random weights (more than L2 holds) run back to
back inside one CUDA graph; median over >= 50 replays. Bytes counted per layer from the actual
routing: packed weights + block scales of the touched experts + x read + out written. Also times a
BF16 grouped-GEMM baseline (`torch._grouped_mm` on dequantized experts) and the plain-PyTorch
reference, and a device-to-device copy in the same run (the ceiling).

    python perf/bench_nvfp4_moe.py --out perf/results/nvfp4_moe_h200.json
    DLMC_NVFP4_KERNEL=v3 python perf/bench_nvfp4_moe.py   # a kernel variant (v1 .. v4)
    python perf/bench_nvfp4_moe.py --tokens 32 --kernels v3 v4 v5 v6  # one process
                                                                  # set-up each, same weights
v4 reads block scales pre-decoded to bf16 (2 bytes per 16 weights): they are converted once,
before timing, as the model does at load, and its bytes count them at 2 bytes.
    python perf/bench_nvfp4_moe.py --smoke   # tiny shapes, any device: checks the script runs
    python perf/bench_nvfp4_moe.py --shared-expert   # + a BF16 shared expert per layer

`--shared-expert` gives every layer a BF16 shared expert of the routed width and times it both
ways in the same run: as the op's BF16 tail blocks (`nvfp4_moe(..., shared_gate=...)`, what
`DLMC_NVFP4_SHARED=fused` runs) and separately (the op, then cuBLAS gate/up/down + SiLU and a
bf16 add, as `separate` runs); bytes include the shared expert's 3 * I * H * 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke on a CPU machine: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dlmc.custom_ops.nvfp4_moe as nvfp4_module
from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_moe_gluon, _nvfp4_self_route
from dlmc.custom_ops._nvfp4_gluon_ring import RING_EMPTY
from dlmc.custom_ops.nvfp4_moe import (
    _KERNEL_NAME,
    _KERNELS,
    effective_variant,
    nvfp4_moe,
    nvfp4_moe_reference,
)
from dlmc.custom_ops.nvfp4_words import ROWS, stored_forms
from dlmc.quant.nvfp4_format import dequantize_nvfp4

PROJ_SHAPES = {"gate": ("I", "H"), "up": ("I", "H"), "down": ("H", "I")}


def make_layer(E: int, H: int, I: int, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Random packed experts in op-argument order (never zeros: random codes and scales)."""
    dims = {"H": H, "I": I}
    args = []
    for out_name, in_name in PROJ_SHAPES.values():
        out_f, in_f = dims[out_name], dims[in_name]
        packed = torch.randint(0, 256, (E, out_f, in_f // 2), dtype=torch.uint8, device=device,
                               generator=gen)
        scale_bytes = torch.randint(0x30, 0x48, (E, out_f, in_f // 16), dtype=torch.uint8,
                                    device=device, generator=gen)  # E4M3 in [0.5, 4)
        scale_2 = torch.rand(E, device=device, generator=gen) * 1e-3 + 1e-3
        args += [packed, scale_bytes.view(torch.float8_e4m3fn), scale_2]
    return args


def kernel_layer(layer: list[torch.Tensor], kernel: str) -> list[torch.Tensor]:
    """The layer's op arguments in the form `kernel` reads, as `NVFP4Experts.prepare_for_kernel`
    stores them (`nvfp4_words.stored_forms`)."""
    inter, hidden = layer[0].shape[1], layer[0].shape[2] * 2  # gate weight [E, I, H/2]
    variant = effective_variant(hidden, inter, _KERNELS[kernel])  # what the op then runs
    out = []
    for p in range(3):  # (weight, block scale, global scale) per projection
        out += [*stored_forms(layer[3 * p], layer[3 * p + 1], variant), layer[3 * p + 2]]
    return out


def make_routing(T: int, E: int, K: int, device: str, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, device=device, generator=gen).argsort(dim=1)[:, :K]  # distinct
    weights = torch.rand(T, K, device=device, generator=gen)
    return ids.to(torch.int32), weights / weights.sum(dim=1, keepdim=True)


# LLaDA2.1-mini's MoE layer for the probes: experts, hidden, width, top-k, block tokens, layers
LLADA = (256, 2048, 512, 8, 32, 19)


def llada_layers(device: str, gen: torch.Generator
                 ) -> tuple[list[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`LLADA`'s layers in v7's stored forms and a uniform routing per layer (the probes')."""
    E, H, I, K, T, L = LLADA
    layers = [kernel_layer(make_layer(E, H, I, device, gen), "v7") for _ in range(L)]
    return layers, [make_routing(T, E, K, device, gen) for _ in range(L)]


def graphs_in_turn(runs: dict[str, object], passes: int, iters: int, layers: int
                   ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each of `runs` (name -> callable) captured as a CUDA graph, the graphs replayed in turn
    `passes` times: (median over the passes of each pass's median, in µs per layer; the
    passes' medians). The probes' timing (a slow pass hits every form alike)."""
    graphs = {}
    for name, run in runs.items():
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            run()
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(passes):
        for name, graph in graphs.items():
            medians[name].append(statistics.median(cuda_times(graph.replay, iters))
                                 / layers * 1e3)
    return {name: statistics.median(values) for name, values in medians.items()}, medians


def write_report(checks: dict, us: dict[str, float], medians: dict[str, list[float]],
                 base: str, out: Path | None) -> None:
    """Print each form's µs per layer (its difference to `base`, its passes) and `checks`;
    write them, the command and the versions to `out` as JSON."""
    for name, value in us.items():
        print(f"{name:8s} {value:7.2f} us/layer  ({value - us[base]:+.2f})  "
              f"passes {[round(v, 2) for v in medians[name]]}")
    print(f"checks: {checks}")
    report = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), **checks,
              "us_per_layer": us, "pass_medians_us": medians,
              f"minus_{base}_us": {name: us[name] - us[base] for name in us}}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


def make_shared(H: int, I: int, device: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A BF16 shared expert as `nvfp4_moe`'s `shared_*` keyword arguments."""
    shapes = {"shared_gate": (I, H), "shared_up": (I, H), "shared_down": (H, I)}
    return {name: (torch.randn(shape, device=device, generator=gen) * shape[1] ** -0.5)
            .bfloat16() for name, shape in shapes.items()}


def separate_shared(x: torch.Tensor, shared: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unfused block's shared expert: `SwiGLUMLP` in bf16 (cuBLAS on the GPU)."""
    F = torch.nn.functional
    h = F.silu(F.linear(x, shared["shared_gate"])) * F.linear(x, shared["shared_up"])
    return F.linear(h, shared["shared_down"])


def grouped_bf16(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                 weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """BF16 baseline: sorted pairs, torch._grouped_mm per projection, fp32 combine."""
    T, K = ids.shape
    E = weights["gate"].shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    a = x[order // K]  # [P, H]
    g = torch._grouped_mm(a, weights["gate"].transpose(1, 2), offs=offs)
    u = torch._grouped_mm(a, weights["up"].transpose(1, 2), offs=offs)
    y = torch._grouped_mm(torch.nn.functional.silu(g) * u, weights["down"].transpose(1, 2),
                          offs=offs)  # [P, H]
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(T, K, -1).float() * w[..., None]).sum(1).to(torch.bfloat16)


def kernel_times(run: object, layers: int, reps: int = 5) -> dict[str, float]:
    """Each CUDA kernel's time per layer in µs (mean of `reps` eager runs of `layers` layers)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    return {event.key[:80]: round(event.device_time_total / (reps * layers), 3)
            for event in prof.key_averages() if event.device_time_total > 0}


def _down_choice(text: str) -> str:
    """`--downs` entry: triton, gluon[:TICKETS[,SHARED_IN_GATE_UP[,STAGES,PER_SM,MAXNREG]]]
    (gluon-gu: the same with the Gluon gate/up), fused or
    fused:STAGES,PER_SM,MAXNREG[,TICKETS[,X_TMA]]."""
    name, _, config = text.partition(":")
    values = config.split(",")
    ok = name in ("triton", "gluon", "gluon-gu", "fused") and (not config or (
        all(v.isdigit() for v in values)
        and len(values) in ((3, 4, 5) if name == "fused" else (1, 2, 5) if "gluon" in name
                            else ())))
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected triton, gluon[-gu][:TICKETS[,SHARED_IN_GATE_UP[,STAGES,PER_SM,"
            "MAXNREG]]], fused or "
            "fused:STAGES,PER_SM,MAXNREG[,TICKETS[,X_TMA]]")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=19)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing")
    parser.add_argument("--shared-expert", action="store_true",
                        help="a BF16 shared expert per layer: timed as the op's tail blocks and "
                             "separately (cuBLAS SwiGLU + bf16 add)")
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="launch configs to sweep, each BLOCK_N,BLOCK_K,num_warps,num_stages"
                             "[,maxnreg] (default: the op's own choice)")
    parser.add_argument("--kernels", nargs="+", choices=sorted(_KERNELS), default=[_KERNEL_NAME],
                        help="kernel variants to time one after the other in this process "
                             "(default: DLMC_NVFP4_KERNEL's)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each kernel's CUDA time per layer (torch.profiler)")
    parser.add_argument("--downs", nargs="+", type=_down_choice,
                        default=[_nvfp4_down_gluon.MODE],
                        help="down kernels to time one after the other in this process "
                             "(DLMC_NVFP4_DOWN: triton, gluon or fused; gluon and fused: sm_90 "
                             "and v7 only); fused:STAGES,PER_SM,MAXNREG[,TICKETS[,X_TMA]] sets the "
                             "fused kernel's ring depth, programs per SM, registers, (1) "
                             "items by a ticket counter and (0) x rows loaded by the consumers "
                             "instead of copied by TMA; gluon:0 / gluon:1 the Gluon down "
                             "kernel's items by program / by a ticket counter "
                             "(DLMC_NVFP4_DOWN_TICKETS, 1 by default); gluon:1,1 also runs the "
                             "shared expert's down parts in gate/up's launch "
                             "(DLMC_NVFP4_SHARED_DOWN=gate_up); gluon:T,S,STAGES,PER_SM,MAXNREG "
                             "also sets the Gluon down kernel's ring depth, programs per SM "
                             "and registers; gluon-gu[:...]: the same after the Gluon gate/up "
                             "(DLMC_NVFP4_GATE_UP=gluon, without a shared expert)")
    parser.add_argument("--tile-kernel", choices=["both", "gate_up", "down"], default="both",
                        help="which kernel --tiles applies to (the other keeps its default)")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.inter, args.experts, args.layers = [5], 32, 32, 8, 2
        args.top_k = 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    E, H, I, K, L = args.experts, args.hidden, args.inter, args.top_k, args.layers
    layers = [make_layer(E, H, I, device, gen) for _ in range(L)]
    shared = [make_shared(H, I, device, gen) if args.shared_expert else {} for _ in range(L)]
    shared_bytes = 3 * I * H * 2 if args.shared_expert else 0
    report: dict[str, object] = {
        "command": " ".join(sys.argv), "settings": vars(args) | {"out": str(args.out)},
        "kernel": args.kernels[0] if len(args.kernels) == 1 else args.kernels,
        "tile_rows": ROWS,  # rows per contiguous run of v5-v7's layout (DLMC_NVFP4_TILE_ROWS)
        "ring_empty": RING_EMPTY,  # how the Gluon kernels hand ring slots back
        "self_route": _nvfp4_self_route.SELF_ROUTE,  # whether gate/up programs route themselves
        "torch": torch.__version__, "python": platform.python_version(), "results": [],
    }
    if device == "cuda":
        import triton

        report |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                   "triton": triton.__version__}
        report["copy_GBps"] = copy_bandwidth_gbps(1 << 30, 30)
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles] or [None]
    nvfp4_module._TILE_KERNEL = args.tile_kernel
    inputs = {}  # per token count: the same routing and x for every kernel
    tickets = _nvfp4_down_gluon.TICKETS  # the Gluon down kernel's defaults
    shared_down = _nvfp4_down_gluon.SHARED_DOWN
    gate_up = _nvfp4_down_gluon.GATE_UP
    fused_defaults = {name: getattr(_nvfp4_moe_gluon, name)
                      for name in ("STAGES", "PROGRAMS_PER_SM", "MAXNREG", "TICKETS", "X_TMA")}
    down_defaults = {name: getattr(_nvfp4_down_gluon, name)
                     for name in ("STAGES", "PROGRAMS_PER_SM", "MAXNREG")}
    converted: dict[str, list[list[torch.Tensor]]] = {}
    first_outputs: dict[tuple, torch.Tensor] = {}
    for kernel, down, T, tile in ((k, d, T, t) for k in args.kernels for d in args.downs
                                  for T in args.tokens for t in tiles):
        name = down.split(":")[0]
        _nvfp4_down_gluon.MODE = "gluon" if name == "gluon-gu" else name
        _nvfp4_down_gluon.GATE_UP = "gluon" if name == "gluon-gu" else gate_up
        values = [int(v) for v in down.split(":")[1].split(",")] if ":" in down else []
        gluon_config = down.startswith(("gluon:", "gluon-gu:"))
        _nvfp4_down_gluon.TICKETS = bool(values[0]) if gluon_config else tickets
        _nvfp4_down_gluon.SHARED_DOWN = ("gate_up" if gluon_config and len(values) > 1
                                         and values[1] else shared_down)
        # the fused kernel's launch settings: the module's defaults, or the entry's
        fused_settings = dict(zip(("STAGES", "PROGRAMS_PER_SM", "MAXNREG", "TICKETS", "X_TMA"),
                                  values, strict=False)) if down.startswith("fused:") else {}
        for name, default in fused_defaults.items():
            setattr(_nvfp4_moe_gluon, name, type(default)(fused_settings.get(name, default)))
        down_settings = dict(zip(down_defaults, values[2:], strict=False)) if gluon_config else {}
        for name, default in down_defaults.items():
            setattr(_nvfp4_down_gluon, name, down_settings.get(name, default))
        nvfp4_module._TILE = tile
        nvfp4_module._VARIANT = _KERNELS[kernel]
        if T not in inputs:
            inputs[T] = ([make_routing(T, E, K, device, gen) for _ in range(L)],
                         torch.randn(T, H, device=device, generator=gen).bfloat16())
        routing, x = inputs[T]
        if kernel not in converted:  # once per kernel (v4: the load-time scale conversion)
            converted = {kernel: [kernel_layer(layer, kernel) for layer in layers]}
        kernel_layers = converted[kernel]
        scale_bytes = 2 if kernel in ("v4", "v6") else 1  # v7's codes: one byte
        expert_bytes = 3 * (I * H // 2 + I * H // 16 * scale_bytes)  # packed + block scales
        touched = [int(ids.unique().numel()) for ids, _ in routing]
        nbytes = [t * expert_bytes + shared_bytes + 2 * T * H * 2 for t in touched]

        def run_all(x: torch.Tensor = x, routing: list = routing,
                    kernel_layers: list = kernel_layers) -> list[torch.Tensor]:
            return [nvfp4_moe(x, ids, w, *layer, **sh) for (ids, w), layer, sh
                    in zip(routing, kernel_layers, shared, strict=True)]

        def run_separate(x: torch.Tensor = x, routing: list = routing,
                         kernel_layers: list = kernel_layers) -> list[torch.Tensor]:
            return [nvfp4_moe(x, ids, w, *layer) + separate_shared(x, sh) for (ids, w), layer, sh
                    in zip(routing, kernel_layers, shared, strict=True)]

        outs = run_all()
        ref = nvfp4_moe_reference(x, *routing[0], *layers[0], **shared[0])
        err = ((outs[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row: dict[str, object] = {"kernel": kernel, "down": down, "tokens": T,
                                  "tile": tile or "default",
                                  "tile_kernel": args.tile_kernel,
                                  "touched_experts_mean": sum(touched) / L,
                                  "bytes_per_layer": sum(nbytes) / L, "max_rel_err_vs_ref": err}
        first = first_outputs.setdefault((T, tile), outs[0])  # the first kernel's layer 0
        row[f"equal_to_{args.kernels[0]}"] = bool(torch.equal(outs[0].view(torch.int16),
                                                              first.view(torch.int16)))
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            ms = statistics.median(cuda_times(graph.replay, args.iters)) / L
            row |= {"nvfp4_ms_per_layer": ms, "nvfp4_GBps": row["bytes_per_layer"] / ms / 1e6}
            row["fraction_of_copy"] = row["nvfp4_GBps"] / report["copy_GBps"]
            row["eager_ms_per_layer"] = statistics.median(cuda_times(run_all, 10)) / L
            if args.profile:
                row["kernel_us_per_layer"] = kernel_times(run_all, L)
            if args.shared_expert:  # the unfused block, same layers, same run
                separate = torch.cuda.CUDAGraph()
                with torch.cuda.graph(separate):
                    run_separate()
                sms = statistics.median(cuda_times(separate.replay, args.iters)) / L
                row |= {"separate_shared_ms_per_layer": sms,
                        "separate_shared_GBps": row["bytes_per_layer"] / sms / 1e6,
                        "fused_minus_separate_ms_per_layer": ms - sms}
            if len(tiles) > 1:  # a sweep: the op alone
                report["results"].append(row)
                print(f"kernel={kernel} T={T} tile={tile} ms/layer={ms:.4f} "
                      f"of_copy={row['fraction_of_copy']:.3f} err={err:.2e} "
                      f"experts={row['touched_experts_mean']:.1f} "
                      f"kernels={row.get('kernel_us_per_layer', '')}", flush=True)
                continue
            ids0, w0 = routing[0]
            bf16 = dict(zip(("gate", "up", "down"), (
                dequantize_nvfp4(*layers[0][3 * p: 3 * p + 3]) for p in range(3)), strict=True))
            try:
                bms = statistics.median(cuda_times(partial(grouped_bf16, x, ids0, w0, bf16), 20))
                row |= {"bf16_grouped_mm_ms": bms,
                        "bf16_grouped_mm_GBps": (touched[0] * 3 * I * H * 2) / bms / 1e6}
            except (RuntimeError, AttributeError) as error:
                row["bf16_grouped_mm_error"] = str(error).splitlines()[0]
            row["reference_ms"] = statistics.median(
                cuda_times(partial(nvfp4_moe_reference, x, ids0, w0, *layers[0]), 3))
        else:
            start = time.perf_counter()
            run_all()
            row["smoke_seconds"] = time.perf_counter() - start
            if args.shared_expert:
                separate = run_separate()[0].float()
                row["fused_vs_separate_max_rel"] = ((outs[0].float() - separate).abs().max()
                                                    / separate.abs().max()).item()
        report["results"].append(row)
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in row.items()))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
