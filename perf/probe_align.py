"""How long `moe_align` takes by itself (session 39): the LLaDA2.1-mini routing (32 tokens x
top-8 of 256, uniform, 16-slot blocks) aligned `--copies` times in one CUDA graph (no PDL, so
each launch waits for the one before and nothing else), at each of `--warps` (4: the default),
against the same number of one-element `torch.add` launches (the floor of a dependent launch).
`--parts`: also the alignment's pieces alone (each a kernel of its own that stores its
result): the histogram and block scans (`front`), those and the 256-key bitonic sort
(`front_sort`), those and the padding and tail stores (`front_pad`).
In the round's profile `moe_align` shows 3.7 µs per layer, but it is launched with PDL there,
so that figure includes its wait for `moe_route`.

    python3 perf/probe_align.py --out perf/results/s39/align.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from dlmc.bench.timing import graph_us, launch_floor_us
from dlmc.custom_ops.moe_align import (
    _sort_ascending,
    align_launch,
    align_pairs_to_blocks_reference,
    moe_align_kernel,
    route_block_m,
)

T, K, E = 32, 8, 256


@triton.jit
def _part_kernel(ids_ptr, sorted_pair_ptr, out_ptr, num_pairs, NUM_BLOCKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, LOG_PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                 FILL: tl.constexpr, SORT: tl.constexpr, PAD: tl.constexpr):
    """`align_pairs`' first part (load, histogram, the two scans), then with `SORT` its key
    sort, with `PAD` its padding and tail stores; stores what it computed."""
    PAIRS_PAD: tl.constexpr = 2**LOG_PAIRS_PAD
    pair = tl.arange(0, PAIRS_PAD)
    is_pair = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=is_pair, other=0).to(tl.int32)
    counts = tl.histogram(expert, EXPERTS_PAD, mask=is_pair)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    block_start = block_end - blocks
    seg_start = tl.cumsum(counts, 0) - counts
    tl.store(out_ptr + tl.arange(0, EXPERTS_PAD), block_start + seg_start)
    if SORT:
        key = tl.where(is_pair, expert, EXPERTS_PAD) * PAIRS_PAD + pair
        key = _sort_ascending(key, LOG_PAIRS_PAD)
        tl.store(out_ptr + EXPERTS_PAD + pair, key)
    if PAD:
        row = tl.arange(0, BLOCK_M)
        last_row = (blocks - 1)[:, None] * BLOCK_M + row[None, :]
        is_pad = (blocks > 0)[:, None] & (last_row >= counts[:, None])
        tl.store(sorted_pair_ptr + block_start[:, None] * BLOCK_M + last_row, num_pairs,
                 mask=is_pad)
        used = tl.sum(blocks, 0)
        fill = tl.arange(0, FILL)
        for start in range(0, NUM_BLOCKS * BLOCK_M, FILL):
            s = start + fill
            tail = s - used * BLOCK_M
            tl.store(sorted_pair_ptr + s, num_pairs, mask=(tail >= 0) & (s < NUM_BLOCKS * BLOCK_M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--parts", action="store_true", help="also time the pieces")
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
    if args.parts:
        scratch = torch.empty(E + 512, dtype=torch.int32, device=device)
        for name, sort, pad in (("front", False, False), ("front_sort", True, False),
                                ("front_pad", False, True)):
            def part(_: int, sort: bool = sort, pad: bool = pad) -> None:
                _part_kernel[(1,)](ids.reshape(-1), sorted_pair, scratch, T * K,
                                   NUM_BLOCKS=constants["NUM_BLOCKS"], BLOCK_M=block_m,
                                   LOG_PAIRS_PAD=constants["LOG_PAIRS_PAD"],
                                   EXPERTS_PAD=constants["EXPERTS_PAD"], FILL=constants["FILL"],
                                   SORT=sort, PAD=pad, num_warps=default_warps)
            us = graph_us(part, args.copies, args.iters)
            report["us_per_call"][name] = us
            print(f"{name:18s}: {us:6.2f} us per call")
    us = report["us_per_call"]["one_element_add"] = launch_floor_us(device, args.copies,
                                                                     args.iters)
    print(f"one-element add:    {us:6.2f} us per call")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
