"""Benchmark DiffusionGemma's step proposal alone: `dlmc::canvas_propose` vs the torch ops.

One denoising step's proposal at the canvas's shape (256 positions x 262144 logits, fp32
soft-capped logits and Exp(1) noise in, the bf16 self-conditioning input written): the torch
form (`canvas_rules.propose` + `self_conditioning_input`, compiled by Inductor as the step is,
`compile_options(canvas=True)`) and the Triton op, each compiled at the one compile site and
replayed as a CUDA graph (median of `--iters` replays, CUDA events). Both read the logits and
the noise and write the bf16 input: `bytes` is that traffic, `of_copy` its time at the copy
bandwidth measured in the same run over the measured time. The outputs are compared (argmax
and the self-conditioning input bit for bit, the sample, the entropy to 1e-5).

    python perf/bench_canvas_sampler.py --out /tmp/sampler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
from dlmc.custom_ops.canvas_propose import canvas_propose
from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS
from dlmc.graphs.canvas_rules import propose, self_conditioning_input
from dlmc.graphs.compile import compiled


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args()


def torch_form(logits, noise, temp, sc, stopped) -> tuple[torch.Tensor, ...]:
    proposal = propose(logits, temp, noise)
    sc.copy_(self_conditioning_input(proposal.tempered, sc, stopped, sc.dtype))
    return proposal.sample, proposal.argmax, proposal.entropy


def triton_form(logits, noise, temp, sc, stopped) -> tuple[torch.Tensor, ...]:
    return canvas_propose(logits, noise, temp, sc, stopped)


def captured(fn: Callable[..., tuple[torch.Tensor, ...]], name: str, inputs: tuple
             ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    step = compiled(name, fn, DEFAULT_KERNELS, canvas=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*inputs)
    return graph, out


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_canvas_sampler: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.canvas, args.vocab)
    logits = 30.0 * torch.tanh(torch.randn(shape, device="cuda", generator=gen) * 0.2)
    noise = torch.empty(shape, device="cuda").exponential_(1.0, generator=gen)
    temp = torch.tensor(0.6, device="cuda")
    stopped = torch.zeros((), dtype=torch.bool, device="cuda")
    nbytes = logits.numel() * (4 + 4 + 2)
    copy = copy_bandwidth_gbps()
    rows, outs = {}, {}
    for name, fn in (("torch", torch_form), ("triton", triton_form)):
        sc = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        graph, out = captured(fn, f"bench_sampler_{name}", (logits, noise, temp, sc, stopped))
        us = statistics.median(cuda_times(graph.replay, args.iters, warmup=3)) * 1e3
        graph.replay()
        outs[name] = (*out, sc)
        rows[name] = {"us": us, "gbps": nbytes / us / 1e3,
                      "of_copy": nbytes / (copy * 1e3) / us}
        print(f"{name:7s} {us:9.1f} µs  {rows[name]['gbps']:7.0f} GB/s  "
              f"{100 * rows[name]['of_copy']:5.1f} % of copy")
    (ts, ta, te, tsc), (gs, ga, ge, gsc) = outs["torch"], outs["triton"]
    checks = {"argmax_equal": bool(torch.equal(ta, ga)), "sc_equal": bool(torch.equal(tsc, gsc)),
              "sample_equal": bool(torch.equal(ts, gs)),
              "entropy_max_abs_diff": float((te - ge).abs().max())}
    print(f"copy {copy:.0f} GB/s, {nbytes / 1e6:.0f} MB per proposal; "
          f"triton / torch = {rows['triton']['us'] / rows['torch']['us']:.3f}; {checks}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": list(shape), "bytes": nbytes, "copy_gbps": copy, **rows,
                       "checks": checks, "device": torch.cuda.get_device_name()}, f, indent=2)


if __name__ == "__main__":
    main()
