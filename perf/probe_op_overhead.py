"""Host time of one `dlmc::nvfp4_moe` call, with and without `moe_overlap`'s counted PDL launches.

Session 20: `perf/bench_nvfp4_moe.py`'s eager figure per layer went from 0.34 to 0.72 ms with
the counted launches (the graph-replayed op got faster). This times the op's host side alone on
LLaDA2.1-mini expert shapes (one layer, stored forms as loaded): the mean host time per call of
100 calls launched back to back (synchronized after), in this process's registration (opaque
unless `DLMC_NVFP4_OVERLAP=0`), with the counters on and off (`moe_overlap.MODE`), and the GPU
time of those 100 calls. Run it once per registration:

    python3 perf/probe_op_overhead.py --out perf/results/s20/overhead_opaque.json
    DLMC_NVFP4_OVERLAP=0 python3 perf/probe_op_overhead.py --out .../overhead_traced.json

(Call 6 timed the traced registration with the counters on too: 354 µs. The counters now need
the opaque registration, so that row repeats the counters-off one.)

Session 22 measured 598 / 646 µs opaque (counters off / on) and 512 / 484 traced, with host and
GPU time equal in every row. `--per-launch` adds a row that splits the host time of each call
into its kernel launches (`_pdl.launcher`, per kernel name) and the rest of the op; session 23:
287 / 625 µs, of which 392 µs outside the launches with the counters on. `--trace` profiles 20
calls (CPU and CUDA activities) to find where that goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from dlmc.custom_ops import _pdl, moe_overlap
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.custom_ops.nvfp4_cases import (  # noqa: E402
    op_args,
    random_experts,
    random_routing,
    shared_expert,
    stored,
)


def per_launch_host_time(op: list, shared: dict, calls: int) -> dict[str, float]:
    """Mean host µs per op call spent in each kernel's launch (`_pdl.launcher`), the op's total
    and the rest, with the counters on."""
    spent: dict[str, float] = {}
    original = _pdl._Launcher.__getitem__

    def timed(self: _pdl._Launcher, grid: object) -> object:
        launch = original(self, grid)
        name = getattr(getattr(self.kernel, "fn", None), "__name__", None) or str(self.kernel)

        def run(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return launch(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return run

    moe_overlap.MODE = "1"
    _pdl._Launcher.__getitem__ = timed
    try:
        for _ in range(10):
            nvfp4_moe(*op, **shared)
        torch.cuda.synchronize()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            nvfp4_moe(*op, **shared)
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        _pdl._Launcher.__getitem__ = original
    row = {name: round(t / calls * 1e6, 1) for name, t in spent.items()}
    row["op_total"] = round(total / calls * 1e6, 1)
    row["outside_launches"] = round((total - sum(spent.values())) / calls * 1e6, 1)
    return row


def trace_calls(op: list, shared: dict, calls: int) -> dict[str, object]:
    """torch.profiler over `calls` op calls with the counters on: the CPU-side table (self CPU
    time per event, driver calls included) and the synchronizing driver calls seen."""
    from torch.profiler import ProfilerActivity, profile

    moe_overlap.MODE = "1"
    for _ in range(5):
        nvfp4_moe(*op, **shared)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            nvfp4_moe(*op, **shared)
        torch.cuda.synchronize()
    events = prof.key_averages()
    syncs = {e.key: e.count for e in events
             if "Synchronize" in e.key or "Memcpy" in e.key or "EventQuery" in e.key}
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    return {"calls": calls, "sync_like_events": syncs, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--per-launch", action="store_true",
                        help="also split the host time per kernel launch (counters on)")
    parser.add_argument("--trace", action="store_true",
                        help="also profile 20 calls with the counters on (torch.profiler, CPU "
                        "and CUDA): where the host time goes, and any synchronizing call")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    experts = stored(random_experts(gen, 256, 2048, 512))
    x = torch.randn(32, 2048, generator=gen).bfloat16().cuda()
    ids, w = random_routing(gen, 32, 256, 8, False)
    op = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, x, 2048, 512)
    report: dict[str, object] = {"command": " ".join(sys.argv), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name(),
                                 "DLMC_NVFP4_OVERLAP": os.environ.get("DLMC_NVFP4_OVERLAP"),
                                 "opaque_registration": moe_overlap.OPAQUE_OP, "rows": []}
    for mode in ("0", "1"):
        moe_overlap.MODE = mode
        for _ in range(10):
            nvfp4_moe(*op, **shared)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.calls):
            nvfp4_moe(*op, **shared)
        end.record()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        row = {"counters": mode, "active": moe_overlap.overlap_active(x.device),
               "host_us_per_call": round(host, 1),
               "gpu_us_per_call": round(start.elapsed_time(end) * 1e3 / args.calls, 1)}
        report["rows"].append(row)
        print(row, flush=True)
    if args.per_launch:
        report["per_launch"] = per_launch_host_time(op, shared, args.calls)
        print(report["per_launch"], flush=True)
    if args.trace:
        report["trace"] = trace_calls(op, shared, 20)
        print(report["trace"]["table"], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
