"""Benchmark `dlmc::bf16_moe` alone at LLaDA2.1-mini or DiffusionGemma shapes, with launch-config
and block_m sweeps.

Default (`--shape llada2.1-mini`): H=2048, I=512, 256 routed experts + the fused shared expert
(expert 256, every token, weight 1), top-8, 32 tokens, 19 layers. `--shape diffusiongemma`:
H=2816, I=704, 128 experts, top-8, 256 tokens (a canvas), gelu-tanh, gate and up read in place
from the fused `gate_up_proj [E, 2I, H]`, 8 layers; `--grouped-mm` adds a row for the model's
`torch._grouped_mm` path on the same weights. Uniform random routing with distinct experts,
layers of distinct random weights run back to back in one CUDA graph; median over the replays.
Bytes per layer from the actual routing (touched experts' gate/up/down weights + x + out).
Ceilings measured in the same run: device copy (read + write) and a read-only sum.

    python perf/bench_bf16_moe.py --out perf/results/bf16_moe_h200.json
    python perf/bench_bf16_moe.py --kernel gate_up --configs 64,128,4,3 128,64,4,4
    python perf/bench_bf16_moe.py --shape diffusiongemma --grouped-mm --block-m 16 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

import dlmc.custom_ops.bf16_moe as bf16_module
from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times, read_bandwidth_gbps
from dlmc.custom_ops.bf16_moe import bf16_moe, bf16_moe_reference
from dlmc.models.diffusion_gemma_moe import grouped_gelu_moe

SHAPES = {  # name: (experts, hidden, inter, top_k, tokens, layers, shared expert, activation)
    "llada2.1-mini": (256, 2048, 512, 8, 32, 19, True, "silu"),
    "diffusiongemma": (128, 2816, 704, 8, 256, 8, False, "gelu_tanh"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llada2.1-mini")
    p.add_argument("--tokens", type=int, default=None, help="default: the shape's")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", choices=["gate_up", "down"], default="gate_up",
                   help="which kernel --configs applies to (the other keeps its default)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="BLOCK_N,BLOCK_K,num_warps,num_stages each (default: the op's own)")
    p.add_argument("--block-m", type=int, nargs="*", default=[],
                   help="rows per M-block to time with the default launch (16, 32, 64)")
    p.add_argument("--grouped-mm", action="store_true",
                   help="also time torch._grouped_mm (DiffusionGemma's model path; no shared "
                        "expert)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    E, H, I, K, T, L, shared, activation = SHAPES[args.shape]
    T, L = args.tokens or T, args.layers or L
    if args.grouped_mm and shared:
        p.error("--grouped-mm: the model path has no shared expert (use --shape diffusiongemma)")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen) * 0.02).bfloat16()

    if args.shape == "diffusiongemma":  # gate and up: the halves of the checkpoint's gate_up
        fused = [(weights((E, 2 * I, H)), weights((E, H, I))) for _ in range(L)]
        layers = [(gu[:, :I], gu[:, I:], down) for gu, down in fused]
    else:
        layers = [(weights((E + 1, I, H)), weights((E + 1, I, H)), weights((E + 1, H, I)))
                  for _ in range(L)]
    routing = []
    for _ in range(L):
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]  # distinct
        w = torch.rand(T, K, device="cuda", generator=gen)
        w = w / w.sum(1, keepdim=True)
        if shared:
            ids = torch.cat([ids, torch.full((T, 1), E, device="cuda")], dim=1)
            w = torch.cat([w, torch.ones(T, 1, device="cuda")], dim=1)
        routing.append((ids.to(torch.int32), w))
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    touched = [int(ids.unique().numel()) for ids, _ in routing]
    nbytes = statistics.mean(t * 3 * I * H * 2 + 2 * T * H * 2 for t in touched)
    report: dict[str, object] = {
        "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "shape": args.shape,
        "copy_GBps": copy_bandwidth_gbps(1 << 30, 30), "read_GBps": read_bandwidth_gbps(1 << 30),
        "touched_experts_mean": statistics.mean(touched), "bytes_per_layer": nbytes,
        "default_launch": bf16_module._DEFAULT_LAUNCH, "results": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    ref = bf16_moe_reference(x, *routing[0], *layers[0], activation=activation).float()

    def op(ids: torch.Tensor, w: torch.Tensor, layer: int) -> torch.Tensor:
        return bf16_moe(x, ids, w, *layers[layer], activation=activation)

    def grouped(ids: torch.Tensor, w: torch.Tensor, layer: int) -> torch.Tensor:
        return grouped_gelu_moe(x, ids.long(), w, *fused[layer])

    variants = [("default", None, None, op)]
    variants += [(f"{args.kernel}={c}", tuple(int(v) for v in c.split(",")), None, op)
                 for c in args.configs]
    variants += [(f"block_m={m}", None, m, op) for m in args.block_m]
    variants += [("grouped_mm", None, None, grouped)] if args.grouped_mm else []
    for name, config, block_m, fn in variants:
        bf16_module._LAUNCH = dict(bf16_module._DEFAULT_LAUNCH)
        if config is not None:
            bf16_module._LAUNCH[args.kernel] = config
        bf16_module._BLOCK_M = block_m

        def run_all(fn=fn) -> list[torch.Tensor]:
            return [fn(ids, w, i) for i, (ids, w) in enumerate(routing)]

        try:
            err = float((run_all()[0].float() - ref).abs().max() / ref.abs().max())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            times = [t / L for t in cuda_times(graph.replay, args.iters, warmup=3)]
        except Exception as error:  # noqa: BLE001 (a config that does not compile or fit)
            print(f"{name} failed: {str(error).splitlines()[0][:120]}")
            continue
        ms = statistics.median(times)
        row = {"variant": name, "config": config or "default", "block_m": block_m,
               "us_per_layer": ms * 1e3, "min_us": min(times) * 1e3, "GBps": nbytes / ms / 1e6,
               "max_rel_err": err}
        row["of_copy"] = row["GBps"] / report["copy_GBps"]
        row["of_read"] = row["GBps"] / report["read_GBps"]
        report["results"].append(row)
        print(f"{name} us/layer={row['us_per_layer']:.1f} GB/s={row['GBps']:.0f} "
              f"of_copy={row['of_copy']:.3f} of_read={row['of_read']:.3f} err={err:.1e}",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
