"""What do `nvfp4_moe`'s two serial edges, the alignment and the combine, cost the op alone?

Per layer, CUDA graphs of 19 layers at LLaDA2.1-mini shapes (32 tokens x top-8, uniform
routing, routed experts only, the defaults), the same inputs in four forms:

    full        the op as the bench times it (alignment, gate/up, down, combine)
    aligned     the routing aligned before capture (`routing=`): no alignment launch
    pairs       `pairs=True`: the pair rows, no combine launch
    neither     both

The graphs are replayed in turn, `--passes` times, and each form's median over its passes'
medians is reported (µs per layer), with its difference to `full`: what the edge costs on the
op's critical path (the profile's kernel times overlap under PDL).

    python3 perf/probe_op_edges.py --out perf/results/s29/probe_op_edges.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_nvfp4_moe import LLADA, graphs_in_turn, llada_layers, write_report  # noqa: E402

from dlmc.custom_ops.moe_align import route_pairs  # noqa: E402
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe  # noqa: E402

FORMS = {"full": (False, False), "aligned": (True, False), "pairs": (False, True),
         "neither": (True, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    E, H, I, K, T, L = LLADA
    layers, routing = llada_layers(device, gen)
    x = torch.randn(T, H, device=device, generator=gen).bfloat16()
    aligned = [route_pairs(ids, E) for ids, _ in routing]

    def run(prealigned: bool, pairs: bool) -> list[torch.Tensor]:
        return [nvfp4_moe(x, ids, w, *layer, routing=pr if prealigned else None, pairs=pairs)
                for (ids, w), layer, pr in zip(routing, layers, aligned, strict=True)]

    outs = {name: run(*form) for name, form in FORMS.items()}
    same = (torch.equal(outs["full"][0], outs["aligned"][0])
            and torch.equal(outs["pairs"][0], outs["neither"][0]))
    us, medians = graphs_in_turn({name: partial(run, *form) for name, form in FORMS.items()},
                                 args.passes, args.iters, L)
    write_report({"outputs_equal_with_and_without_alignment": same}, us, medians, "full", args.out)


if __name__ == "__main__":
    main()
