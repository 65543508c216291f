"""Would the LLaDA shared expert cost less on a second stream, beside the router's launches?

In the NVFP4 round the shared expert runs inside `nvfp4_moe` (extra programs of its Triton
gate/up and down launches), which keeps the round's op off the Gluon gate/up and its
self-routing (routed experts alone: ~88.5 µs per layer; with the shared expert 93-95). Moving
it into the router's launches was 0.38 ms per round slower (perf/README.md, session 30): its
parts, few and serial there, became latency-bound. Here it runs as `SwiGLUMLP`'s three cuBLAS
GEMMs on a side stream, forked before the router GEMM and joined after the op, so its
latency overlaps the router, the routing and the op.

Per layer, CUDA graphs of 19 layers at LLaDA2.1-mini shapes (32 tokens, x the same for every
layer, random router weights, the op's pair rows without its combine, which the round sums
in the next norm):

    fused     router GEMM, routing, the op with the shared expert (the round today)
    side      the shared expert on a side stream; router GEMM, routing, the op routed-only
    side_op   the same, forked after the routing (beside the op alone: what one opaque op
              holding the experts and the shared expert could do)
    serial    the same launches on one stream (`DLMC_NVFP4_SHARED=separate`)
    routed    router GEMM, routing, the op routed-only (no shared expert: the bound)

The graphs are replayed in turn, `--passes` times; each form's median over its passes'
medians is reported (µs per layer) with its difference to `fused`.

    python3 perf/probe_shared_stream.py --out perf/results/s31/probe_shared_stream.json
    python3 perf/probe_shared_stream.py --smoke   # CPU: tiny shapes under Triton's interpreter,
                                                  # one stream, the output checks only
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_nvfp4_moe import (  # noqa: E402  (sets TRITON_INTERPRET without a GPU)
    LLADA,
    graphs_in_turn,
    kernel_layer,
    make_layer,
    make_shared,
    separate_shared,
    write_report,
)

from dlmc.custom_ops.moe_route import moe_route  # noqa: E402
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe  # noqa: E402
from dlmc.custom_ops.router_gemm import router_gemm  # noqa: E402
from dlmc.models.shapes import LLADA21_MINI  # noqa: E402

FORMS = ("fused", "side", "side_op", "serial", "routed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (Triton's interpreter): output checks only")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, I, K, T, L = (16, 256, 256, 8, 4, 2) if args.smoke else LLADA
    cfg = LLADA21_MINI
    # the routing comes from each layer's router here
    layers = [kernel_layer(make_layer(E, H, I, device, gen), "v7") for _ in range(L)]
    shared = [make_shared(H, I, device, gen) for _ in range(L)]
    routers = [(torch.randn(E, H, device=device, generator=gen) * H ** -0.5,
                torch.randn(E, device=device, generator=gen) * 0.01) for _ in range(L)]
    x = torch.randn(T, H, device=device, generator=gen).bfloat16()
    side = None if args.smoke else torch.cuda.Stream()

    def route(router: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_route(router_gemm(x, router[0]), router[1], cfg.n_group, cfg.topk_group,
                         cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         cfg.routed_scaling_factor)

    def layer(form: str, weights: list[torch.Tensor], sh: dict[str, torch.Tensor],
              router: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if form in ("side", "side_op") and side is not None:
            main_stream = torch.cuda.current_stream()
            if form == "side_op":
                ids, w = route(router)
            side.wait_stream(main_stream)  # fork: x (and for side_op the routing) is ready
            with torch.cuda.stream(side):
                shared_out = separate_shared(x, sh)
            if form == "side":
                ids, w = route(router)
            rows = nvfp4_moe(x, ids, w, *weights, pairs=True)
            main_stream.wait_stream(side)  # join before the rows are summed
            return rows, shared_out
        if form in ("serial", "side", "side_op"):  # the side forms on one stream in --smoke
            shared_out = separate_shared(x, sh)
            ids, w = route(router)
            return nvfp4_moe(x, ids, w, *weights, pairs=True), shared_out
        ids, w = route(router)
        return (nvfp4_moe(x, ids, w, *weights, pairs=True, **(sh if form == "fused" else {})),)

    def run(form: str) -> list[tuple[torch.Tensor, ...]]:
        return [layer(form, *parts) for parts in zip(layers, shared, routers, strict=True)]

    outs = {form: run(form) for form in FORMS}
    if not args.smoke:
        torch.cuda.synchronize()
    P = K + 1  # the fused op's pair rows per token: K routed, then the shared expert's
    fused_rows = outs["fused"][0][0].view(T, P, H)
    same = {"side_vs_routed": torch.equal(outs["side"][0][0], outs["routed"][0][0]),
            "side_op_vs_routed": torch.equal(outs["side_op"][0][0], outs["routed"][0][0]),
            "serial_vs_routed": torch.equal(outs["serial"][0][0], outs["routed"][0][0]),
            "fused_routed_rows_vs_routed": torch.equal(fused_rows[:, :K].reshape(T * K, H),
                                                       outs["routed"][0][0]),
            "side_shared_vs_serial": torch.equal(outs["side"][0][1], outs["serial"][0][1])}
    if args.smoke:
        print(f"outputs equal: {same}")
        sys.exit(0 if all(same.values()) else 1)
    us, medians = graphs_in_turn({form: partial(run, form) for form in FORMS}, args.passes,
                                 args.iters, L)
    write_report({"outputs_equal": same}, us, medians, "fused", args.out)


if __name__ == "__main__":
    main()
