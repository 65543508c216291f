"""Benchmark `dlmc::nvfp4_moe` at LLaDA2 or DiffusionGemma expert shapes against copy bandwidth.

Default: H=2048, I=512, E=256, top-8, 32 tokens (one diffusion block), uniform random routing with
distinct experts per token, 19 layers of distinct random weights (more than L2 holds) run back to
back inside one CUDA graph; median over >= 50 replays. Bytes counted per layer from the actual
routing: packed weights + one-byte block-scale codes of the touched experts + x read + out
written. Also times a BF16 grouped-GEMM baseline (`torch._grouped_mm` on dequantized experts),
the plain-PyTorch reference, and a device-to-device copy in the same run (the ceiling).

    python perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --out op.json
    python perf/bench_nvfp4_moe.py --tokens 32 --shared-expert   # + a BF16 shared expert
    python perf/bench_nvfp4_moe.py --tokens 32 --no-pdl          # without PDL (KernelConfig.pdl)
    python perf/bench_nvfp4_moe.py --smoke   # tiny shapes, any device: checks the script runs
    # DiffusionGemma's experts at its 256-token canvas (kernel v3, GELU), the op's own tiles
    # and another configuration (`NVFP4Tiles` fields over the op's choice), one process each:
    python perf/bench_nvfp4_moe.py --hidden 2816 --inter 704 --experts 128 --tokens 256 \
        --activation gelu_tanh --layers 12
    python perf/bench_nvfp4_moe.py --hidden 2816 --inter 704 --experts 128 --tokens 256 \
        --activation gelu_tanh --layers 12 --tiles block_m=16

`--shared-expert` gives every layer a BF16 shared expert of the routed width and times it both
ways in the same run: inside the op's launches (`nvfp4_moe(..., shared_gate=...)`, what the
model runs) and separately (the op, then cuBLAS gate/up/down + SiLU and a bf16 add); bytes
include the shared expert's 3 * I * H * 2.
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

from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
from dlmc.custom_ops.nvfp4_moe import effective_variant, nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_moe_tiles import ACTIVATIONS, NVFP4Tiles, default_tiles
from dlmc.custom_ops.nvfp4_words import stored_forms
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


def kernel_layer(layer: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layer's op arguments in the form the op's kernel reads, as
    `NVFP4Experts.prepare_for_kernel` stores them (`nvfp4_words.stored_forms`)."""
    inter, hidden = layer[0].shape[1], layer[0].shape[2] * 2  # gate weight [E, I, H/2]
    variant = effective_variant(hidden, inter)
    out = []
    for p in range(3):  # (weight, block scale, global scale) per projection
        out += [*stored_forms(layer[3 * p], layer[3 * p + 1], variant), layer[3 * p + 2]]
    return out


def make_routing(T: int, E: int, K: int, device: str, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, device=device, generator=gen).argsort(dim=1)[:, :K]  # distinct
    weights = torch.rand(T, K, device=device, generator=gen)
    return ids.to(torch.int32), weights / weights.sum(dim=1, keepdim=True)


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
                 weights: dict[str, torch.Tensor], activation: str = "silu") -> torch.Tensor:
    """BF16 baseline: sorted pairs, torch._grouped_mm per projection, fp32 combine."""
    T, K = ids.shape
    E = weights["gate"].shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    a = x[order // K]  # [P, H]
    g = torch._grouped_mm(a, weights["gate"].transpose(1, 2), offs=offs)
    u = torch._grouped_mm(a, weights["up"].transpose(1, 2), offs=offs)
    act = (torch.nn.functional.silu(g) if activation == "silu"
           else torch.nn.functional.gelu(g, approximate="tanh"))
    y = torch._grouped_mm(act * u, weights["down"].transpose(1, 2), offs=offs)  # [P, H]
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


def graph_ms(run: object, iters: int) -> float:
    """Median ms of `run` captured once as a CUDA graph and replayed `iters` times."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return statistics.median(cuda_times(graph.replay, iters))


def parse_args() -> argparse.Namespace:
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
                        help="a BF16 shared expert per layer: timed inside the op's launches "
                             "and separately (cuBLAS SwiGLU + bf16 add)")
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                        help="the op's programmatic dependent launches (KernelConfig.pdl)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each kernel's CUDA time per layer (torch.profiler)")
    parser.add_argument("--activation", choices=ACTIVATIONS, default="silu",
                        help="the experts' gated activation (DiffusionGemma: gelu_tanh)")
    parser.add_argument("--tiles", default=None,
                        help="NVFP4Tiles fields over the op's own choice for each token count, "
                             "e.g. block_m=32,down_block_k=64 (the Triton kernels then run both "
                             "projections); unset: the op's choice (default_tiles)")
    args = parser.parse_args()
    if args.activation != "silu" and args.shared_expert:
        parser.error("--shared-expert is a SwiGLU MLP: it needs --activation silu")
    if args.smoke:
        args.tokens, args.hidden, args.inter, args.experts, args.layers = [5], 32, 32, 8, 2
        args.top_k = 2
    return args


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    E, H, I, K, L = args.experts, args.hidden, args.inter, args.top_k, args.layers
    layers = [make_layer(E, H, I, device, gen) for _ in range(L)]
    kernel_layers = [kernel_layer(layer) for layer in layers]
    shared = [make_shared(H, I, device, gen) if args.shared_expert else {} for _ in range(L)]
    shared_bytes = 3 * I * H * 2 if args.shared_expert else 0
    expert_bytes = 3 * (I * H // 2 + I * H // 16)  # packed weights + one-byte scale codes
    variant = effective_variant(H, I)

    def tiles_for(T: int) -> NVFP4Tiles | None:
        """`--tiles` over the op's choice for T tokens, or None (the op chooses)."""
        if args.tiles is None:
            return None
        return NVFP4Tiles.parse(args.tiles, default_tiles(T, K, E, H, I, variant))

    def tile_text(T: int) -> str:
        """The tiles that run: `--tiles`, or the op's (whose Gluon kernels, where they apply,
        have tiles of their own)."""
        chosen = tiles_for(T)
        if chosen is not None:
            return chosen.describe()
        return "op's choice (routed experts): " + default_tiles(T, K, E, H, I,
                                                                variant).describe()

    report: dict[str, object] = {
        "command": " ".join(sys.argv), "settings": vars(args) | {"out": str(args.out)},
        "kernel": f"v{effective_variant(H, I)}", "torch": torch.__version__,
        "python": platform.python_version(), "results": []}
    if device == "cuda":
        import triton

        report |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                   "triton": triton.__version__, "copy_GBps": copy_bandwidth_gbps(1 << 30, 30)}
    for T in args.tokens:
        routing = [make_routing(T, E, K, device, gen) for _ in range(L)]
        x = torch.randn(T, H, device=device, generator=gen).bfloat16()
        touched = [int(ids.unique().numel()) for ids, _ in routing]
        nbytes = [t * expert_bytes + shared_bytes + 2 * T * H * 2 for t in touched]

        options = {"pdl": args.pdl, "activation": args.activation, "tiles": tiles_for(T)}

        def run_all(x: torch.Tensor = x, routing: list = routing,
                    options: dict = options) -> list[torch.Tensor]:
            return [nvfp4_moe(x, ids, w, *layer, **options, **sh) for (ids, w), layer, sh
                    in zip(routing, kernel_layers, shared, strict=True)]

        def run_separate(x: torch.Tensor = x, routing: list = routing,
                         options: dict = options) -> list[torch.Tensor]:
            return [nvfp4_moe(x, ids, w, *layer, **options) + separate_shared(x, sh)
                    for (ids, w), layer, sh in zip(routing, kernel_layers, shared, strict=True)]

        outs = run_all()
        ref = nvfp4_moe_reference(x, *routing[0], *layers[0], **shared[0],
                                  activation=args.activation)
        err = ((outs[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row: dict[str, object] = {"tokens": T, "touched_experts_mean": sum(touched) / L,
                                  "bytes_per_layer": sum(nbytes) / L, "max_rel_err_vs_ref": err,
                                  "tiles": tile_text(T)}
        if device == "cuda":
            ms = graph_ms(run_all, args.iters) / L
            row |= {"nvfp4_ms_per_layer": ms, "nvfp4_GBps": row["bytes_per_layer"] / ms / 1e6}
            row["fraction_of_copy"] = row["nvfp4_GBps"] / report["copy_GBps"]
            row["eager_ms_per_layer"] = statistics.median(cuda_times(run_all, 10)) / L
            if args.profile:
                row["kernel_us_per_layer"] = kernel_times(run_all, L)
            if args.shared_expert:  # the unfused block, same layers, same run
                sms = graph_ms(run_separate, args.iters) / L
                row |= {"separate_shared_ms_per_layer": sms,
                        "separate_shared_GBps": row["bytes_per_layer"] / sms / 1e6,
                        "fused_minus_separate_ms_per_layer": ms - sms}
            ids0, w0 = routing[0]
            bf16 = dict(zip(("gate", "up", "down"), (
                dequantize_nvfp4(*layers[0][3 * p: 3 * p + 3]) for p in range(3)), strict=True))
            try:
                bms = statistics.median(cuda_times(partial(grouped_bf16, x, ids0, w0, bf16,
                                                           args.activation), 20))
                row |= {"bf16_grouped_mm_ms": bms,
                        "bf16_grouped_mm_GBps": (touched[0] * 3 * I * H * 2) / bms / 1e6}
            except (RuntimeError, AttributeError) as error:
                row["bf16_grouped_mm_error"] = str(error).splitlines()[0]
            row["reference_ms"] = statistics.median(cuda_times(partial(
                nvfp4_moe_reference, x, ids0, w0, *layers[0], activation=args.activation), 3))
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
