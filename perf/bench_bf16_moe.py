"""Benchmark `dlmc::bf16_moe` alone at LLaDA2.1-mini shapes, with launch-config sweeps.

Default: H=2048, I=512, 256 routed experts + the fused shared expert (expert 256, every token,
weight 1), top-8, 32 tokens, uniform random routing with distinct experts, 19 layers of distinct
random weights run back to back in one CUDA graph; median over the replays. Bytes per layer from
the actual routing (touched experts' gate/up/down weights + x + out). Ceilings measured in the
same run: device copy (read + write) and a read-only sum.

    python perf/bench_bf16_moe.py --out perf/results/bf16_moe_h200.json
    python perf/bench_bf16_moe.py --kernel gate_up --configs 64,128,4,3 128,64,4,4
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", choices=["gate_up", "down"], default="gate_up",
                   help="which kernel --configs applies to (the other keeps its default)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="BLOCK_N,BLOCK_K,num_warps,num_stages each (default: the op's own)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    E, H, I, K, T, L = 256, 2048, 512, 8, args.tokens, args.layers
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen) * 0.02).bfloat16()

    layers = [(weights((E + 1, I, H)), weights((E + 1, I, H)), weights((E + 1, H, I)))
              for _ in range(L)]
    routing = []
    for _ in range(L):
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]  # distinct
        w = torch.rand(T, K, device="cuda", generator=gen)
        ids = torch.cat([ids, torch.full((T, 1), E, device="cuda")], dim=1).to(torch.int32)
        routing.append((ids, torch.cat([w / w.sum(1, keepdim=True),
                                        torch.ones(T, 1, device="cuda")], dim=1)))
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    touched = [int(ids.unique().numel()) for ids, _ in routing]
    nbytes = statistics.mean(t * 3 * I * H * 2 + 2 * T * H * 2 for t in touched)
    report: dict[str, object] = {
        "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_bandwidth_gbps(1 << 30, 30), "read_GBps": read_bandwidth_gbps(1 << 30),
        "touched_experts_mean": statistics.mean(touched), "bytes_per_layer": nbytes,
        "default_launch": bf16_module._DEFAULT_LAUNCH, "results": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    ref = bf16_moe_reference(x, *routing[0], *layers[0]).float()
    for config in [None, *(tuple(int(v) for v in c.split(",")) for c in args.configs)]:
        bf16_module._LAUNCH = dict(bf16_module._DEFAULT_LAUNCH)
        if config is not None:
            bf16_module._LAUNCH[args.kernel] = config

        def run_all() -> list[torch.Tensor]:
            return [bf16_moe(x, ids, w, *layer) for (ids, w), layer in zip(routing, layers,
                                                                           strict=True)]

        try:
            err = float((run_all()[0].float() - ref).abs().max() / ref.abs().max())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            times = [t / L for t in cuda_times(graph.replay, args.iters, warmup=3)]
        except Exception as error:  # noqa: BLE001 (a config that does not compile or fit)
            print(f"{args.kernel}={config} failed: {str(error).splitlines()[0][:120]}")
            continue
        ms = statistics.median(times)
        row = {"kernel": args.kernel, "config": config or "default", "us_per_layer": ms * 1e3,
               "min_us": min(times) * 1e3, "GBps": nbytes / ms / 1e6, "max_rel_err": err}
        row["of_copy"] = row["GBps"] / report["copy_GBps"]
        row["of_read"] = row["GBps"] / report["read_GBps"]
        report["results"].append(row)
        print(f"{args.kernel}={row['config']} us/layer={row['us_per_layer']:.1f} "
              f"GB/s={row['GBps']:.0f} of_copy={row['of_copy']:.3f} "
              f"of_read={row['of_read']:.3f} err={err:.1e}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
