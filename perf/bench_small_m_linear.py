"""Benchmark `dlmc::small_m_linear` against cuBLAS (`F.linear`) at LLaDA2.1-mini's skinny GEMMs.

32 bf16 tokens times: qkv `[3072, 2048]`, o_proj `[2048, 2048]`, the dense MLP's fused gate/up
`[10240, 2048]` and down `[2048, 5120]` (bf16 weights), and the MoE router `[256, 2048]` (fp32
weight, fp32 logits). Each GEMM runs over 20 distinct random weights inside one CUDA graph (more
bytes than L2 holds); median over the replays, per GEMM. `--configs` sweeps the Triton launch
config of `small_m_linear` (`bf16:BLOCK_N,BLOCK_K,num_warps,num_stages`) on the bf16 weights.

The router row times `dlmc::router_gemm` (BF16 tensor cores on a three-way split of the fp32
weight, split-K partials; `fp32split:BLOCK_N,SPLITS,BLOCK_K,num_warps,num_stages` sweeps it) and,
since its partials are summed inside `dlmc::moe_route`, GEMM + routing for both ("route ..." rows).
"... + align" rows add the experts' routing prep (`route_pairs`: `dlmc::moe_align`, with the
fused shared expert as BF16 rounds run it, "shared"), "... fused" rows run both in one
`dlmc::moe_route_align` launch instead (what MoEBlock runs with DLMC_FUSED_ROUTE_ALIGN=on);
`--fused-warps` adds fused rows at other num_warps.

    python perf/bench_small_m_linear.py --out perf/results/small_m_linear_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import dlmc.custom_ops.moe_route_align as mra
import dlmc.custom_ops.router_gemm as rg
import dlmc.custom_ops.small_m_linear as sml
import dlmc.custom_ops.split_k_linear as skl
from dlmc.bench.timing import copy_bandwidth_gbps, graph_us

SHAPES = {"qkv": (3072, 2048, torch.bfloat16), "o_proj": (2048, 2048, torch.bfloat16),
          "mlp_gate_up": (10240, 2048, torch.bfloat16), "mlp_down": (2048, 5120, torch.bfloat16),
          "router": (256, 2048, torch.float32)}


def route_align_rows(x: torch.Tensor, ws: list[torch.Tensor], bias: torch.Tensor,
                     routing: tuple, fused_warps: list[int], copies: int,
                     iters: int) -> dict[str, float]:
    """router_gemm + moe_route + moe_align (two launches after the GEMM) against router_gemm +
    moe_route_align (one), without and with the shared expert (BF16 rounds fuse it)."""
    from dlmc.custom_ops.moe_align import route_pairs
    from dlmc.custom_ops.moe_route import moe_route

    def two_launches(i: int, shared: bool) -> object:
        ids, _ = moe_route(rg.router_gemm(x, ws[i]), bias, *routing)
        return route_pairs(ids, bias.shape[0], shared)

    rows = {}
    for shared in (False, True):
        tag = " shared" if shared else ""
        rows[f"route router_gemm + align{tag}"] = graph_us(
            lambda i, s=shared: two_launches(i, s), copies, iters)
        for warps in [None, *fused_warps]:
            mra._NUM_WARPS = warps
            label = f"route router_gemm fused{tag}" + (f" w{warps}" if warps else "")
            try:
                rows[label] = graph_us(lambda i, s=shared: mra.moe_route_align(
                    rg.router_gemm(x, ws[i]), bias, *routing, s), copies, iters)
            finally:
                mra._NUM_WARPS = None
    return rows


def router_rows(x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor,
                split_configs: list[tuple[str, tuple[int, ...]]], copies: int,
                iters: int) -> dict[str, float]:
    """`dlmc::router_gemm` per config, and GEMM + `dlmc::moe_route` (LLaDA2.1-mini's routing)
    against cuBLAS + `dlmc::moe_route`."""
    from dlmc.custom_ops.moe_route import moe_route

    bias = torch.randn(ws[0].shape[0], device="cuda") * 0.1
    routing = (8, 4, 8, True, 2.5)  # n_group, topk_group, top_k, norm, scaling
    rows = {"route cublas": graph_us(
        lambda i: moe_route(F.linear(x.float(), ws[i]), bias, *routing), copies, iters)}
    default = rg._CONFIG
    for label, config in split_configs:
        rg._CONFIG = config
        try:
            err = float((rg.router_gemm(x, ws[0]).sum(0) - ref).abs().max() / ref.abs().max())
            rows[f"router_gemm {label}"] = graph_us(lambda i: rg.router_gemm(x, ws[i]), copies,
                                                    iters)
            rows[f"route router_gemm {label}"] = graph_us(
                lambda i: moe_route(rg.router_gemm(x, ws[i]), bias, *routing), copies, iters)
        except Exception as error:  # noqa: BLE001 (a config that does not compile)
            print(f"router_gemm {label} failed: {str(error).splitlines()[0][:120]}")
            continue
        finally:
            rg._CONFIG = default
        rows[f"err router_gemm {label}"] = err
    return rows


def split_k_rows(x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor,
                 configs: list[tuple[str, tuple[int, ...]]], copies: int,
                 iters: int) -> dict[str, float]:
    """`dlmc::split_k_linear` per config: the partials alone (their sum rides in the consumer's
    kernel in a round) and with the sum as its own kernel."""
    rows = {}
    default = skl._CONFIG
    for label, config in configs:
        skl._CONFIG = config
        try:
            out = skl.split_k_linear(x, ws[0]).sum(0)
            rows[f"err splitk {label}"] = float((out - ref).abs().max() / ref.abs().max())
            rows[f"splitk {label}"] = graph_us(lambda i: skl.split_k_linear(x, ws[i]), copies,
                                               iters)
            rows[f"splitk {label} + sum"] = graph_us(
                lambda i: skl.split_k_linear(x, ws[i]).sum(0).to(torch.bfloat16), copies, iters)
        except Exception as error:  # noqa: BLE001 (a config that does not compile)
            print(f"splitk {label} failed: {str(error).splitlines()[0][:120]}")
        finally:
            skl._CONFIG = default
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--copies", type=int, default=20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--configs", nargs="*", default=[],
                   help="bf16:BLOCK_N,BLOCK_K,num_warps,num_stages (dlmc::small_m_linear), "
                   "splitk:BLOCK_N,SPLITS,BLOCK_K,num_warps,num_stages (dlmc::split_k_linear), or "
                   "fp32split:BLOCK_N,SPLITS,BLOCK_K,num_warps,num_stages (dlmc::router_gemm)")
    p.add_argument("--fused-warps", type=int, nargs="*", default=[],
                   help="also time dlmc::moe_route_align at these num_warps (default: its own)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, 2048, device="cuda").bfloat16()
    x_wide = torch.randn(args.tokens, 5120, device="cuda").bfloat16()
    report: dict[str, object] = {
        "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_bandwidth_gbps(1 << 30, 30),
        "default_config": sml._CONFIG,
        "router_gemm_config": rg._CONFIG, "results": []}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    split_configs = [("default", rg._CONFIG)] + [
        (c, tuple(int(v) for v in c.split(":")[1].split(",")))
        for c in args.configs if c.startswith("fp32split:")]
    configs = [("default", sml._CONFIG)] + [
        (c, tuple(int(v) for v in c.split(":")[1].split(",")))
        for c in args.configs if c.startswith("bf16:")]
    split_k_configs = [("default", skl._CONFIG)] + [
        (c, tuple(int(v) for v in c.split(":")[1].split(",")))
        for c in args.configs if c.startswith("splitk:")]
    default = sml._CONFIG
    for name, (n, k, dtype) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").to(dtype) * 0.02 for _ in range(args.copies)]
        xi = x if k == 2048 else x_wide
        ref = F.linear(xi.to(dtype), ws[0]).float()
        rows = {"cublas": graph_us(lambda i, xi=xi, d=dtype, ws=ws: F.linear(xi.to(d), ws[i]),
                                   args.copies, args.iters)}
        for label, config in configs if dtype == torch.bfloat16 else ():
            sml._CONFIG = config
            try:
                err = float((sml.small_m_linear(xi, ws[0]).float() - ref).abs().max()
                            / ref.abs().max())
                rows[f"triton {label}"] = graph_us(
                    lambda i, xi=xi, ws=ws: sml.small_m_linear(xi, ws[i]), args.copies,
                    args.iters)
            except Exception as error:  # noqa: BLE001 (a config that does not compile)
                print(f"{name} {label} failed: {str(error).splitlines()[0][:120]}")
                continue
            rows[f"err {label}"] = err
        sml._CONFIG = default
        if dtype == torch.bfloat16:
            rows |= split_k_rows(xi, ws, ref, split_k_configs, args.copies, args.iters)
        if name == "router":
            rows |= router_rows(xi, ws, ref, split_configs, args.copies, args.iters)
            bias = torch.randn(n, device="cuda") * 0.1
            rows |= route_align_rows(xi, ws, bias, (8, 4, 8, True, 2.5), args.fused_warps,
                                     args.copies, args.iters)
        nbytes = n * k * ws[0].element_size()
        for label, us in rows.items():
            if label.startswith("err"):
                continue
            err = rows.get(f"err {label.removeprefix('triton ')}")
            report["results"].append({"gemm": name, "impl": label, "us": us,
                                      "GBps": nbytes / us / 1e3, "max_rel_err": err})
            print(f"{name:12s} {label:32s} {us:7.2f} us {nbytes / us / 1e3:6.0f} GB/s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
