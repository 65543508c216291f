"""Does `nvfp4_moe` get faster when L2 already holds its first experts' gate/up bytes?

Between two MoE layers a round runs about 45 µs of latency-bound launches (norms, attention,
router) during which DRAM is nearly idle. A round's routing barely changes from one round of a
block to the next, so the experts a layer touched last round are a good guess for this round.
This probe asks whether it is worth using that window: per layer, CUDA graph of 19 layers at
LLaDA2.1-mini shapes (32 tokens x top-8, uniform routing, the BF16 shared expert fused):

    none       gap, op                  (gap: a `torch.cuda._sleep` kernel of `--gap-us`)
    warm N     prefetch, gap, op        (prefetch: one launch asking L2 for the gate and up
                                         weights + block scales of the first N experts the op
                                         reads, in its order: ascending expert id)

Reported: µs per layer of each graph (median of `--iters` replays), and the difference to
`none`. The prefetch uses `probe_l2_prefetch.l2_prefetch` (`cp.async.bulk.prefetch.L2`).

    python3 perf/probe_moe_l2_warm.py --out perf/results/s23/probe_moe_l2_warm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from bench_nvfp4_moe import LLADA, llada_layers, make_shared  # noqa: E402
from probe_l2_prefetch import l2_prefetch  # noqa: E402

from dlmc.bench.timing import cuda_times  # noqa: E402
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe  # noqa: E402


@triton.jit
def _warm_experts_kernel(ids_ptr, gate_w, gate_s, up_w, up_s, w_bytes, s_bytes):
    """Program (i, part): ask L2 for expert `ids[i]`'s gate/up weight or block scales."""
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        l2_prefetch(gate_w + expert * w_bytes, w_bytes, 0, 1, True)
    elif part == 1:
        l2_prefetch(up_w + expert * w_bytes, w_bytes, 0, 1, True)
    elif part == 2:
        l2_prefetch(gate_s + expert * s_bytes, s_bytes, 0, 1, True)
    else:
        l2_prefetch(up_s + expert * s_bytes, s_bytes, 0, 1, True)


def warm(ids: torch.Tensor, layer: list[torch.Tensor]) -> None:
    gate_w, gate_s, up_w, up_s = layer[0], layer[1], layer[3], layer[4]
    assert all(t.is_contiguous() for t in (gate_w, gate_s, up_w, up_s))
    w_bytes = gate_w[0].numel() * gate_w.element_size()
    s_bytes = gate_s[0].numel() * gate_s.element_size()
    _warm_experts_kernel[(ids.numel(), 4)](ids, gate_w.view(torch.uint8), gate_s.view(torch.uint8),
                                           up_w.view(torch.uint8), up_s.view(torch.uint8),
                                           w_bytes, s_bytes, num_warps=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--gap-us", type=float, default=30.0)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    E, H, I, K, T, L = LLADA
    layers, routing = llada_layers(device, gen)
    shared = [make_shared(H, I, device, gen) for _ in range(L)]
    x = torch.randn(T, H, device=device, generator=gen).bfloat16()
    experts = [ids.unique().to(torch.int32) for ids, _ in routing]  # ascending
    cycles = int(args.gap_us * 1e-6 * 1.98e9)  # the H200's SM clock (boost)

    def run(n: int) -> None:
        for layer, (ids, w), sh, touched in zip(layers, routing, shared, experts, strict=True):
            if n:
                warm(touched[:n], layer)
            torch.cuda._sleep(cycles)
            nvfp4_moe(x, ids, w, *layer, **sh)

    results = {}
    for n in [0, *args.warm, 0]:
        run(n)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(n)
        us = statistics.median(cuda_times(graph.replay, args.iters, warmup=5)) / L * 1e3
        name = f"warm {n}" if n else "none"
        results.setdefault(name, []).append(us)
        gate_w, gate_s = layers[0][0][0], layers[0][1][0]  # one expert's
        mb = 2 * n * (gate_w.numel() * gate_w.element_size() + gate_s.numel()) / 1e6
        print(f"{name:>8}: {us:7.2f} µs per layer (gap + op), {mb:.1f} MB asked for per layer",
              flush=True)
    base = statistics.median(results["none"])
    report = {"gap_us": args.gap_us, "gap_cycles": cycles, "layers": L, "tokens": T,
              "us_per_layer": results, "gain_us": {k: base - statistics.median(v)
                                                   for k, v in results.items()},
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "command": " ".join(sys.argv)}
    print(json.dumps(report["gain_us"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
