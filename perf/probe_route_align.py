"""How long the LLaDA2.1-mini routing takes by itself (session 40): the router's split-K
partials (`[16, 32, 256]` fp32, random) routed (group-limited top-8 of 256) and aligned for the
experts (16-slot blocks, the shared expert's tail) `--copies` times in one CUDA graph (no PDL:
each launch waits for the one before and nothing else), in these forms:

- `route+align`: `moe_route` (one program per token, its warps) then `moe_align` (one
  program, its warps): the round's default, two launches;
- `last_W`: `moe_route_last_align` at W warps per program (one launch; the last program to
  take a ticket aligns), for each of `--warps`; the op launches it at
  max(moe_align's warps, moe_route's);
- `route_W`: `moe_route` alone at W warps, to see what the warps cost the routing itself;
- `one_W`: `moe_route_align`, one program that routes every token and aligns (`--one-warps`;
  the op launches it at 32);

against one-element `torch.add` launches (the floor of a dependent launch). Every form's ids,
weights and alignment are checked against `moe_route` + `align_pairs_to_blocks_reference`.

    python3 perf/probe_route_align.py --out perf/results/s40/route_align.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dlmc.bench.timing import graph_us, launch_floor_us
from dlmc.custom_ops.moe_align import (
    align_pairs_to_blocks_reference,
    moe_align_kernel,
    route_block_m,
)
from dlmc.custom_ops.moe_route import (
    moe_route_kernel,
    moe_route_reference,
    route_constants,
    route_warps_per_token,
)
from dlmc.custom_ops.moe_route_align import moe_route_align_kernel, route_align_setup
from dlmc.custom_ops.moe_route_last_align import moe_route_last_align_kernel

T, E, SPLITS = 32, 256, 16
N_GROUP, TOPK_GROUP, TOP_K, NORM, SCALE = 8, 4, 8, True, 2.5  # LLaDA2.1-mini's router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--one-warps", type=int, nargs="*", default=[32])
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SPLITS, T, E, generator=gen).to(device)
    bias = (torch.randn(E, generator=gen) * 0.1).to(device)
    ref_ids, ref_weights = moe_route_reference(logits.sum(0), bias, N_GROUP, TOPK_GROUP, TOP_K,
                                               NORM, SCALE)
    block_m = route_block_m(T, TOP_K, E, True)
    ref_pair, ref_block = align_pairs_to_blocks_reference(ref_ids.cpu(), E, block_m, True)
    logits3, outputs, align_constants, align_warps = route_align_setup(logits, TOP_K, block_m,
                                                                       True)
    ids, weights, sorted_pair, expert_of_block = outputs
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    route_kw = route_constants(logits3, N_GROUP, TOPK_GROUP, TOP_K, NORM)
    route_args = (logits3, bias, ids, weights, logits3.stride(0), logits3.stride(1), SCALE)
    report: dict[str, object] = {"command": " ".join(sys.argv), "torch": torch.__version__,
                                 "align_warps": align_warps,
                                 "route_warps": route_warps_per_token(E, N_GROUP),
                                 "us_per_call": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()

    def check(name: str, aligned: bool) -> None:
        same = torch.equal(ids.cpu(), ref_ids.cpu()) and torch.allclose(
            weights.cpu(), ref_weights.cpu(), rtol=1e-6, atol=0)
        if aligned:
            same = same and torch.equal(sorted_pair.cpu(), ref_pair) and torch.equal(
                expert_of_block.cpu(), ref_block)
        if not same:
            sys.exit(f"{name}: another routing or alignment than the reference")

    def route(warps: int) -> None:
        moe_route_kernel[(T,)](*route_args, **route_kw, num_warps=warps)

    def align() -> None:
        moe_align_kernel[(1,)](ids.reshape(-1), sorted_pair, expert_of_block, T * TOP_K, TOP_K,
                               E, **align_constants, num_warps=align_warps)

    def last(warps: int) -> None:
        moe_route_last_align_kernel[(T,)](
            logits3, bias, ids, weights, sorted_pair, expert_of_block, ticket,
            logits3.stride(0), logits3.stride(1), SCALE, E, **align_constants, **route_kw,
            num_warps=warps)

    def one(warps: int) -> None:
        moe_route_align_kernel[(1,)](
            logits3, bias, ids, weights, sorted_pair, expert_of_block, T, logits3.stride(0),
            logits3.stride(1), SCALE, E, TOKENS_PAD=T, **route_kw, **align_constants,
            num_warps=warps)

    forms = [("route+align", lambda _: (route(report["route_warps"]), align()), True)]
    forms += [(f"last_{w}", lambda _, w=w: last(w), True) for w in args.warps]
    forms += [(f"route_{w}", lambda _, w=w: route(w), False) for w in args.warps]
    forms += [(f"one_{w}", lambda _, w=w: one(w), True) for w in args.one_warps]
    times = report["us_per_call"]
    for name, call, aligned in forms:
        sorted_pair.fill_(-7)
        times[name] = graph_us(call, args.copies, args.iters)
        check(name, aligned)
    times["one_element_add"] = launch_floor_us(device, args.copies, args.iters)
    print("\n".join(f"{name:15s}: {us:6.2f} us per call" for name, us in times.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
