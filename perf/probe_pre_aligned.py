"""What `moe_align`'s launch costs the op alone (session 41): `dlmc::nvfp4_moe` on LLaDA2.1-mini's
routed experts (32 tokens x top-8 of 256, uniform routing, 19 layers' weights in one CUDA
graph), in three forms replayed in turn:

- `default`: the op as it runs (`moe_align` launched, then the self-routed Gluon gate/up, the
  Gluon down kernel, `moe_combine`);
- `pre`: each layer's alignment made before capture and passed as `routing=` (no alignment
  launch in the graph; gate/up then waits for the launch before it at its start);
- `pre_self`: the same, with the gate/up programs routing themselves as in `default` (their
  first copies go out before they wait for the launch before them);
- `no_align`: `DLMC_NVFP4_DOWN_SELF_ROUTE=1`: no alignment launch; the self-routed gate/up
  launched first (waiting for the launch before it, then routing), then the down kernel,
  which routes its own items.

`default - pre_self` bounds what an op without the alignment launch (every kernel routing
itself) could win. Every form's outputs are compared with `default`'s, bit for bit, and layer
0 with `nvfp4_moe_reference`.

    python3 perf/probe_pre_aligned.py --out perf/results/s41/pre_aligned.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import dlmc.custom_ops.nvfp4_moe as nvfp4_module
from dlmc.bench.timing import copy_bandwidth_gbps
from dlmc.custom_ops import _nvfp4_down_self_route
from dlmc.custom_ops.moe_align import route_pairs
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nvfp4_moe import LLADA, graphs_in_turn, llada_layers, write_report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_pre_aligned: needs a CUDA GPU (the op's Gluon kernels)")
    E, H, _, _, T, L = LLADA
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, routing = llada_layers("cuda", gen)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).bfloat16()
    pre = [route_pairs(ids, E) for ids, _ in routing]
    torch.cuda.synchronize()
    launch = nvfp4_module.launch_moe_gluon
    forced: dict[str, torch.Tensor | None] = {"ids": None}

    def self_routed(*a: object, **kw: object) -> None:
        """`launch_moe_gluon` with the gate/up programs routing themselves (`forced["ids"]`)."""
        if forced["ids"] is not None:
            kw["topk_ids"] = forced["ids"]
        launch(*a, **kw)

    nvfp4_module.launch_moe_gluon = self_routed

    def run(form: str) -> list[torch.Tensor]:
        outs = []
        _nvfp4_down_self_route.DOWN_SELF_ROUTE = form == "no_align"
        for (ids, w), layer, r in zip(routing, layers, pre, strict=True):
            forced["ids"] = ids if form == "pre_self" else None
            outs.append(nvfp4_moe(x, ids, w, *layer, routing=r if form.startswith("pre")
                                  else None))
        forced["ids"] = None
        _nvfp4_down_self_route.DOWN_SELF_ROUTE = False
        return outs

    forms = ("default", "pre", "pre_self", "no_align")
    results = {form: run(form) for form in forms}
    torch.cuda.synchronize()
    checks = {f"{form}_equals_default": all(torch.equal(a, b) for a, b in
                                            zip(results[form], results["default"], strict=True))
              for form in forms[1:]}
    ref = nvfp4_moe_reference(x, *routing[0], *layers[0]).float()
    checks["default_max_rel_err_vs_ref"] = float(
        (results["default"][0].float() - ref).abs().max() / ref.abs().max())
    copy = copy_bandwidth_gbps()
    us, medians = graphs_in_turn({form: (lambda f=form: run(f)) for form in forms},
                                 args.passes, args.iters, L)
    checks["copy_GBps"] = copy
    write_report(checks, us, medians, "default", args.out)


if __name__ == "__main__":
    main()
