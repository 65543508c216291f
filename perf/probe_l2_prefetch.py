"""Does asking L2 for a GEMM's weight during the short kernels before it make the GEMM faster?

For the round's cuBLAS GEMMs of 32 tokens (qkv `[3072, 2048]`, o_proj `[2048, 2048]`, bf16), one
CUDA graph per case, each starting from a cold L2 (a 256 MB copy first):

    cold      flush, 3 short kernels, GEMM
    warm      flush, GEMM, 3 short kernels, GEMM       (the second GEMM reads L2)
    separate  flush, a prefetch launch, 3 short kernels, GEMM
    first     flush, the first short kernel asks L2 for the weight, 2 more, GEMM
    last      flush, 2 short kernels, the third asks, GEMM (a shorter window)

The short kernels (`_short_kernel`, 32 x 2048 fp32 in place, 16 programs) stand in for the
round's norms and attention launches. Reported: each case's graph time minus the flush's
(median of `--iters` replays, CUDA events) and each kernel's mean time (profiler).

    python3 perf/probe_l2_prefetch.py --out perf/results/s19/probe_l2_prefetch.json

`l2_prefetch` asks L2 for a byte range (`cp.async.bulk.prefetch.L2.global`, sm_90): the programs
of a grid share it, each program's first thread asking for its share in pieces of at most
`PIECE` bytes. Measured on the H200 (session 19, perf/README.md): the GEMM from a warm L2 is
only 1.3-2 µs faster and the kernel that asks gets about 1 µs slower, so nothing is gained; an
`nvfp4_moe` down program asking for its own tile first was slower too, and both were removed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

PIECE = 65536  # bytes per prefetch instruction at most
_PIECE_UNITS = tl.constexpr(PIECE // 16)


@triton.jit
def l2_prefetch(base_ptr, nbytes, program, programs, ENABLED: tl.constexpr):
    """Ask L2 for bytes `[0, nbytes)` from `base_ptr` (16-byte aligned; a tail of under 16
    bytes is left out), as participant `program` of `programs`: its share, in pieces of at most
    `PIECE` bytes, each asked for by the program's first thread."""
    if ENABLED:
        total = (nbytes // 16).to(tl.int64)  # 16-byte units
        share = (total + programs - 1) // programs
        start = program * share
        end = tl.minimum(start + share, total)
        base = base_ptr.to(tl.pointer_type(tl.int8))
        for unit in range(start, end, _PIECE_UNITS):
            size = (tl.minimum(unit + _PIECE_UNITS, end) - unit).to(tl.int32) * 16
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r", [base + unit * 16, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _short_kernel(x_ptr, w_ptr, nbytes, n, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    l2_prefetch(w_ptr, nbytes, tl.program_id(0), tl.num_programs(0), PREFETCH)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * 0.5 + 1.0, mask=offs < n)


@triton.jit
def _prefetch_kernel(w_ptr, nbytes):
    l2_prefetch(w_ptr, nbytes, tl.program_id(0), tl.num_programs(0), True)


def short(x: torch.Tensor, w: torch.Tensor | None) -> None:
    block = 4096
    _short_kernel[(triton.cdiv(x.numel(), block),)](
        x, x if w is None else w, 0 if w is None else w.numel() * w.element_size(), x.numel(),
        PREFETCH=w is not None, BLOCK=block)


def cases(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, flush: tuple[torch.Tensor, ...],
          programs: int) -> dict[str, object]:
    def gemm() -> None:
        torch.nn.functional.linear(a, w)

    def run(name: str) -> None:
        flush[1].copy_(flush[0])
        if name == "warm":
            gemm()
        if name == "separate":
            _prefetch_kernel[(programs,)](w, w.numel() * w.element_size())
        short(x, w if name == "first" else None)
        short(x, None)
        short(x, w if name == "last" else None)
        if name != "flush_only":
            gemm()

    return {name: (lambda name=name: run(name)) for name in
            ("flush_only", "cold", "warm", "separate", "first", "last")}


def graph_of(fn: object) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_times(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # µs
    return times


def kernel_means(graph: torch.cuda.CUDAGraph, reps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    return {event.key[:60]: round(event.device_time_total / max(event.count, 1), 3)
            for event in prof.key_averages() if event.device_time_total > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = (torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device="cuda",
                           generator=gen), torch.empty(256 << 20, dtype=torch.uint8,
                                                       device="cuda"))
    x = torch.randn(32 * 2048, device="cuda", generator=gen)
    a = torch.randn(32, 2048, device="cuda", generator=gen).bfloat16()
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "triton": triton.__version__, "python": platform.python_version(),
                                 "iters": args.iters, "results": []}
    for name, rows in (("qkv", 3072), ("o_proj", 2048)):
        w = (torch.randn(rows, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
        for programs in args.programs:
            graphs = {case: graph_of(fn) for case, fn in cases(x, a, w, flush, programs).items()}
            medians = {case: statistics.median(replay_times(g, args.iters))
                       for case, g in graphs.items()}
            base = medians["flush_only"]
            row = {"gemm": name, "weight_MB": w.numel() * 2 / 1e6, "prefetch_programs": programs,
                   "median_us": medians,
                   "after_flush_us": {c: round(m - base, 3) for c, m in medians.items()},
                   "kernels_us": {c: kernel_means(g, 20) for c, g in graphs.items()}}
            report["results"].append(row)
            print(name, programs, "after flush (µs):", row["after_flush_us"], flush=True)
            for case, kernels in row["kernels_us"].items():
                print("   ", case, {k: v for k, v in kernels.items() if "copy" not in k.lower()
                                    and "Memcpy" not in k})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
