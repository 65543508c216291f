"""How long `moe_align` takes by itself (session 39): the LLaDA2.1-mini routing (32 tokens x
top-8 of 256, uniform, 16-slot blocks) aligned `--copies` times in one CUDA graph (no PDL, so
each launch waits for the one before and nothing else), at each of `--warps` (4: the default),
against the same number of one-element `torch.add` launches (the floor of a dependent launch).
In the round's profile `moe_align` shows 3.7 µs per layer, but it is launched with PDL there,
so that figure includes its wait for `moe_route`.

    python3 perf/probe_align.py --out perf/results/s39/align.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dlmc.bench.timing import graph_us
from dlmc.custom_ops.moe_align import (
    align_launch,
    align_pairs_to_blocks_reference,
    moe_align_kernel,
    route_block_m,
)

T, K, E = 32, 8, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int().to(device)
    block_m = route_block_m(T, K, E)
    constants, default_warps = align_launch(T, K, E, block_m, False)
    expected = align_pairs_to_blocks_reference(ids.cpu(), E, block_m)
    sorted_pair = torch.empty_like(expected[0], device=device)
    expert_of_block = torch.empty_like(expected[1], device=device)
    report: dict[str, object] = {"command": " ".join(sys.argv), "torch": torch.__version__,
                                 "default_warps": default_warps, "us_per_call": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    for warps in args.warps:
        def align(_: int, warps: int = warps) -> None:
            moe_align_kernel[(1,)](ids.reshape(-1), sorted_pair, expert_of_block, T * K, K, E,
                                   **constants, num_warps=warps)
        us = graph_us(align, args.copies, args.iters)
        same = (torch.equal(sorted_pair.cpu(), expected[0])
                and torch.equal(expert_of_block.cpu(), expected[1]))
        report["us_per_call"][f"moe_align_{warps}_warps"] = us
        print(f"moe_align {warps:2d} warps: {us:6.2f} us per call, equal to the reference: {same}")
        if not same:
            sys.exit("moe_align gave another alignment than the reference")
    one = torch.zeros(1, device=device)
    us = graph_us(lambda _: one.add_(1.0), args.copies, args.iters)
    report["us_per_call"]["one_element_add"] = us
    print(f"one-element add:    {us:6.2f} us per call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
