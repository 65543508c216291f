"""Benchmark DiffusionGemma's step proposal alone: `dlmc::canvas_propose` vs the torch ops.

One denoising step's proposal at the canvas's shape (256 positions x 262144 logits): from the
lm_head's bf16 output and the Exp(1) noise to the sample, argmax, entropy and the bf16
self-conditioning input. Three forms, each compiled at the one compile site (as the step is,
`canvas=True`) and replayed as a CUDA graph (median of `--iters` replays, CUDA events):
- `torch`: the soft cap, `canvas_rules.propose` and `self_conditioning_input` as torch ops;
- `triton_capped`: the soft cap by Inductor (fp32 logits written and read), then the op;
- `triton`: the op capping the bf16 values itself (`softcap`), what the step runs; with
  `--tiles`, also once per named work split of its first launch (`ProposeTiles`).
`bytes` is what each form must move (the bf16 values read, the fp32 logits written and read
where a form writes them, the noise read, the input written), `of_copy` that traffic's time at
the copy bandwidth measured in the same run over the measured time. The outputs are compared
with the torch form's (argmax and sample equal, entropy to 1e-5, the input's elements that
differ: the cap's tanh may differ in the last bit).

    python perf/bench_canvas_sampler.py --out /tmp/sampler.json
    python perf/bench_canvas_sampler.py --tiles 8192,1024,8 16384,2048,8
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import torch

from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
from dlmc.custom_ops.canvas_propose import DEFAULT_TILES, ProposeTiles, canvas_propose
from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS
from dlmc.graphs.canvas_rules import propose, self_conditioning_input
from dlmc.graphs.compile import compiled


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiles", nargs="*", default=[], type=parse_tiles,
                   help="work splits of the op to time too: CHUNK,BLOCK,WARPS")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args()


def parse_tiles(text: str) -> ProposeTiles:
    try:
        chunk, block, warps = (int(v) for v in text.split(","))
        return ProposeTiles(chunk, block, warps)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--tiles {text!r}: expected CHUNK,BLOCK,WARPS "
                                         f"({exc})") from None


def tiles_name(tiles: ProposeTiles) -> str:
    return f"triton_{tiles.chunk}_{tiles.block}_w{tiles.num_warps}"


CAP = 30.0  # DiffusionGemma's final_logit_softcapping


def capped(raw: torch.Tensor) -> torch.Tensor:
    return torch.tanh(raw.float() / CAP) * CAP


def torch_form(raw, noise, temp, sc, stopped) -> tuple[torch.Tensor, ...]:
    proposal = propose(capped(raw), temp, noise)
    sc.copy_(self_conditioning_input(proposal.tempered, sc, stopped, sc.dtype))
    return proposal.sample, proposal.argmax, proposal.entropy


def triton_capped_form(raw, noise, temp, sc, stopped) -> tuple[torch.Tensor, ...]:
    return canvas_propose(capped(raw), noise, temp, sc, stopped)


def triton_form(raw, noise, temp, sc, stopped, tiles: ProposeTiles = DEFAULT_TILES
                ) -> tuple[torch.Tensor, ...]:
    return canvas_propose(raw, noise, temp, sc, stopped, CAP, tiles)


# bytes per logit each form must move: bf16 in, fp32 logits out and in, fp32 noise, bf16 input
FORMS = (("torch", torch_form, 2 + 8 + 4 + 2), ("triton_capped", triton_capped_form, 2 + 8 + 4 + 2),
         ("triton", triton_form, 2 + 4 + 2))


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
    raw = (torch.randn(shape, device="cuda", generator=gen) * 6).bfloat16()
    noise = torch.empty(shape, device="cuda").exponential_(1.0, generator=gen)
    temp = torch.tensor(0.6, device="cuda")
    stopped = torch.zeros((), dtype=torch.bool, device="cuda")
    copy = copy_bandwidth_gbps()
    rows, outs = {}, {}
    forms = list(FORMS) + [(tiles_name(t), functools.partial(triton_form, tiles=t), 2 + 4 + 2)
                           for t in args.tiles]
    for name, fn, per_logit in forms:
        sc = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        graph, out = captured(fn, f"bench_sampler_{name}", (raw, noise, temp, sc, stopped))
        us = statistics.median(cuda_times(graph.replay, args.iters, warmup=3)) * 1e3
        graph.replay()
        outs[name] = (*out, sc)
        nbytes = raw.numel() * per_logit
        rows[name] = {"us": us, "bytes": nbytes, "gbps": nbytes / us / 1e3,
                      "of_copy": nbytes / (copy * 1e3) / us}
        print(f"{name:13s} {us:9.1f} µs  {nbytes / 1e6:5.0f} MB  {rows[name]['gbps']:7.0f} GB/s"
              f"  {100 * rows[name]['of_copy']:5.1f} % of copy")
    ts, ta, te, tsc = outs["torch"]
    checks = {}
    for name in [n for n in rows if n != "torch"]:
        gs, ga, ge, gsc = outs[name]
        checks[name] = {"argmax_equal": bool(torch.equal(ta, ga)),
                        "sample_equal": bool(torch.equal(ts, gs)),
                        "sc_elements_differing": int((tsc != gsc).sum()),
                        "entropy_max_abs_diff": float((te - ge).abs().max())}
    print(f"copy {copy:.0f} GB/s; triton / torch = "
          f"{rows['triton']['us'] / rows['torch']['us']:.3f}, triton / triton_capped = "
          f"{rows['triton']['us'] / rows['triton_capped']['us']:.3f}; {checks}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": list(shape), "copy_gbps": copy, **rows, "checks": checks,
                       "device": torch.cuda.get_device_name()}, f, indent=2)


if __name__ == "__main__":
    main()
