"""Shared pieces of the perf/ probes: a compiled Triton/Gluon kernel's sm_90 SASS and resource
line (Triton's bundled cuobjdump, no GPU needed), device times of a launch sequence from CUDA
graph replays, and writing a probe's JSON report.

Imported by the scripts beside it (`python3 perf/<script>.py` puts perf/ on the path)."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import triton

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def require_mbarrier_ring(script: str) -> None:
    """Exit with a message unless the Gluon ring hands slots back by mbarrier
    (`DLMC_NVFP4_RING_EMPTY`): the probes' own consumers and producers wait and arrive on the
    `empty` mbarriers of `ring_barriers`, which named mode replaces."""
    import sys

    from dlmc.custom_ops._nvfp4_gluon_ring import RING_EMPTY

    if RING_EMPTY != "mbarrier":
        sys.exit(f"perf/{script} hands ring slots back by mbarrier: run it with "
                 f"DLMC_NVFP4_RING_EMPTY=mbarrier (got {RING_EMPTY!r})")


def disassemble(compiled: object) -> tuple[str, str]:
    """(SASS text, `cuobjdump -res-usage` text) of a `triton.compile` result's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", cubin.name], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    return sass, usage


def run(parser: argparse.ArgumentParser, compile_only: Callable, run_gpu: Callable) -> None:
    """Parse a probe's arguments (adding `--out`), run its `compile_only(args)` (with
    `--compile-only`: the sm_90 lowering, printed) or `run_gpu(args)`, and write the report to
    `--out` as JSON."""
    parser.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = parser.parse_args()
    report = compile_only(args) if args.compile_only else run_gpu(args)
    if args.compile_only:
        print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def replay_times(run: Callable[[], object], iters: int) -> list[float]:
    """ms per call of `run` (a sequence of kernel launches) as replays of a CUDA graph of it:
    device time. CUDA events around host launches measure the host instead when the launches
    cost as much as the kernels (Gluon launches build their TMA descriptors on the host)."""
    import torch

    from dlmc.bench.timing import cuda_times

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return cuda_times(graph.replay, iters, warmup=3)


def print_rows(report: dict, bytes_per_layer: float) -> dict:
    """Add each timed row's fraction of the copy bandwidth, print the rows (JSON lines) and the
    copy bandwidth; return the report."""
    for row in report["rows"]:
        if "GBps" in row:
            row["fraction_of_copy"] = row["GBps"] / report["copy_GBps"]
        print(json.dumps(row), flush=True)
    print(f"copy {report['copy_GBps']:.0f} GB/s; {bytes_per_layer / 1e6:.1f} MB per layer")
    return report
