"""Benchmark block attention over a paged FP8 KV cache: Triton vs FlashInfer vs reference.

LLaDA2.1-mini shapes by default: a 32-query block, 16 q heads over 4 KV heads, head dim 128,
page size 16, FP8 E4M3 KV, 20 layers. Every layer has its own cache (so the KV is not served
from L2), one CUDA graph holds one call per layer, and a replay's time over the layer count is
the per-call time (median of >= 50 replays, CUDA events). The reference syncs on the prefix
length, so it is timed eagerly. Random data, seeded. `--sweep` also times the named kernel
variants of `SWEEP_VARIANTS` (custom_ops/_paged_attention_launch.py), all or the ones named,
each in its own graph; `--capacity` sizes the page pool beyond the prefix (the speculative
tiles of the interleaved variants read pages up to the pool's capacity, as in a long context).

    python perf/bench_paged_attention.py --sweep --no-flashinfer --out perf/results/x.json
    python perf/bench_paged_attention.py --sweep base ilv32 --prefixes 4096 --capacity 32768
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton

from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
from dlmc.custom_ops.kv_append import kv_append
from dlmc.custom_ops.paged_attention import (
    SWEEP_VARIANTS,
    launch_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from dlmc.custom_ops.paged_attention_flashinfer import (
    FlashInferPagedAttention,
    flashinfer_available,
)

# --sweep times SWEEP_VARIANTS by name ("default" is the op's own launch, `default_variant`:
# `ilv32` for FP8 at head dim 128 on CUDA, else `base`); what each changes:
# PagedAttentionVariant's docstring.


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--num-queries", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--round-ms", type=float, default=1.9, help="NVFP4 round target (ms)")
    p.add_argument("--sweep", nargs="*", default=None, metavar="NAME",
                   help="also time these kernel variants (none named: all of "
                   f"{list(SWEEP_VARIANTS)})")
    p.add_argument("--capacity", type=int, default=0,
                   help="cached tokens the page pool holds (0: the prefix + the block + a page)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer (JIT ~18 s)")
    p.add_argument("--torch-sdpa", action="store_true",
                   help="also time torch's scaled_dot_product_attention (flash, cuDNN and "
                   "memory-efficient backends, GQA) over the same keys laid out contiguously in "
                   "BF16: what a dense library kernel does at the shape, without the cost of "
                   "gathering and dequantizing the pages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON output path")
    return p.parse_args()


def time_graph(calls: list[Callable[[], object]], iters: int) -> list[float]:
    """Per-call microseconds of each replay of one graph that holds all `calls`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_events(graph.replay, iters, len(calls))


def time_events(fn: Callable[[], object], iters: int, per: int, warmup: int = 3) -> list[float]:
    """Microseconds per call when one `fn()` makes `per` calls (CUDA events)."""
    return [t * 1000.0 / per for t in cuda_times(fn, iters, warmup)]


def build(args: argparse.Namespace, prefix: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(args.seed + prefix)
    num_pages = max(math.ceil((prefix + args.num_queries) / args.page_size) + 1,
                    math.ceil(args.capacity / args.page_size))
    shape = (args.layers, num_pages, args.page_size, args.kv_heads, args.head_dim)
    dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    scale = 0.02 if args.kv_dtype == "fp8" else 1.0

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, device="cuda", generator=gen).bfloat16()

    return {  # in paged_attention's argument order
        "q": rand(args.layers, args.num_queries, args.q_heads, args.head_dim),
        "k_new": rand(args.layers, args.num_queries, args.kv_heads, args.head_dim),
        "v_new": rand(args.layers, args.num_queries, args.kv_heads, args.head_dim),
        "k_cache": (rand(*shape).float() / scale).clamp(-448, 448).to(dtype),
        "v_cache": (rand(*shape).float() / scale).clamp(-448, 448).to(dtype),
        "page_table": torch.arange(num_pages, dtype=torch.int32, device="cuda"),
        "prefix_len": torch.tensor([prefix], dtype=torch.int32, device="cuda"),
        "k_scale": torch.tensor([scale], device="cuda"),
        "v_scale": torch.tensor([scale], device="cuda"),
    }


def sweep_names(args: argparse.Namespace) -> list[str]:
    """The variants `--sweep` names (all of them when it names none; [] without --sweep)."""
    if args.sweep is None:
        return []
    unknown = [name for name in args.sweep if name not in SWEEP_VARIANTS]
    if unknown:
        raise SystemExit(f"--sweep: unknown variant(s) {unknown}; known: {list(SWEEP_VARIANTS)}")
    return args.sweep or list(SWEEP_VARIANTS)


def layer_args(t: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    per_layer = ("q", "k_new", "v_new", "k_cache", "v_cache")
    return {name: (x[layer] if name in per_layer else x) for name, x in t.items()}


def bench_prefix(args: argparse.Namespace, prefix: int, env: dict[str, object],
                 record: Callable[[str, str, int, list[float], float], None]) -> None:
    """Time every backend at one prefix length."""
    scale = args.head_dim**-0.5
    t = build(args, prefix)
    opts = {"softmax_scale": scale}
    ref = paged_attention_reference(**layer_args(t, 0), **opts).float()

    def rel_err(out: torch.Tensor, ref: torch.Tensor = ref) -> float:
        return float((out.float() - ref).abs().max() / ref.abs().max())

    calls = [lambda i=i: paged_attention(**layer_args(t, i), **opts)
             for i in range(args.layers)]
    err = rel_err(calls[0]())
    record("triton", "default", prefix, time_graph(calls, args.iters), err)
    record("triton", "default eager", prefix,
           time_events(lambda: [c() for c in calls], args.iters, args.layers), err)
    for name in sweep_names(args):
        def launch(i: int, name: str = name) -> torch.Tensor:
            return launch_paged_attention(*layer_args(t, i).values(), scale, 0, 0, 0,
                                          SWEEP_VARIANTS[name])
        try:
            err = rel_err(launch(0))
            calls = [lambda i=i, f=launch: f(i) for i in range(args.layers)]
            record("triton", name, prefix, time_graph(calls, args.iters), err)
        except Exception as e:  # one failing variant must not cost the others' times
            print(f"triton     {name:28s} prefix={prefix:6d} FAILED {type(e).__name__}: "
                  f"{str(e)[:200]}", flush=True)
            env.setdefault("failed", []).append({"config": name, "prefix": prefix,
                                                 "error": f"{type(e).__name__}: {e}"[:2000]})
            torch.cuda.synchronize()
    if not args.no_flashinfer and flashinfer_available() and args.head_dim in (64, 128, 256):
        fi = FlashInferPagedAttention(
            num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
            page_size=args.page_size, max_pages=t["page_table"].numel(),
            kv_dtype=t["k_cache"].dtype, device=torch.device("cuda"))
        start = time.perf_counter()
        fi.plan(prefix + args.num_queries, args.num_queries, t["page_table"], scale)
        k_s, v_s = float(t["k_scale"]), float(t["v_scale"])

        def fi_append(i: int) -> None:
            a = layer_args(t, i)
            kv_append(a["k_new"], a["v_new"], a["k_cache"], a["v_cache"], a["page_table"],
                      a["prefix_len"], k_scale=a["k_scale"], v_scale=a["v_scale"])

        def fi_run(i: int) -> torch.Tensor:
            return fi.run(t["q"][i], t["k_cache"][i], t["v_cache"][i], k_scale=k_s,
                          v_scale=v_s)

        fi_append(0)
        err = rel_err(fi_run(0))
        torch.cuda.synchronize()
        env[f"flashinfer_first_call_s_{prefix}"] = time.perf_counter() - start
        record("flashinfer", "fa2 run", prefix,
               time_graph([lambda i=i: fi_run(i) for i in range(args.layers)], args.iters),
               err)
        record("flashinfer", "fa2 append+run", prefix, time_graph(
            [lambda i=i: (fi_append(i), fi_run(i)) for i in range(args.layers)],
            args.iters), err)
    if args.torch_sdpa:
        bench_torch_sdpa(args, t, prefix, scale, rel_err, record)
    record("reference", "eager (syncs)", prefix, time_events(
        lambda: [paged_attention_reference(**layer_args(t, i), **opts)
                 for i in range(args.layers)], max(args.iters // 2, 50), args.layers), 0.0)


def bench_torch_sdpa(args: argparse.Namespace, t: dict[str, torch.Tensor], prefix: int,
                     scale: float, rel_err: Callable[[torch.Tensor], float],
                     record: Callable[[str, str, int, list[float], float], None]) -> None:
    """torch SDPA over each layer's cached prefix (dequantized) and own keys, contiguous BF16,
    bidirectional: `[1, H, T, D]` queries against `[1, Hkv, prefix + T, D]` keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense(cache: torch.Tensor, new: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
        cached = cache.flatten(0, 1)[:prefix].float() * kv_scale  # pages in table order
        return torch.cat([cached.bfloat16(), new]).transpose(0, 1)[None].contiguous()

    layers = [(t["q"][i].transpose(0, 1)[None].contiguous(),
               dense(t["k_cache"][i], t["k_new"][i], t["k_scale"]),
               dense(t["v_cache"][i], t["v_new"][i], t["v_scale"])) for i in range(args.layers)]
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        def run(i: int, backend: SDPBackend = backend) -> torch.Tensor:
            q, k, v = layers[i]
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)  # [T, H, D]

        try:
            err = rel_err(run(0))
            record("torch-sdpa", name, prefix,
                   time_graph([lambda i=i, f=run: f(i) for i in range(args.layers)],
                              args.iters), err)
        except Exception as e:  # a backend that refuses the shape (head dim, GQA)
            print(f"torch-sdpa {name:28s} prefix={prefix:6d} FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
            torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    env = {
        "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": None, "settings": vars(args),
    }
    if flashinfer_available():
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    env["copy_GBps"] = copy_bandwidth_gbps(512 * 2**20)
    print(json.dumps({k: v for k, v in env.items() if k != "settings"}), flush=True)
    rows = []

    def record(backend: str, config: str, prefix: int, times: list[float], err: float) -> None:
        kv_bytes = 2 * prefix * args.kv_heads * args.head_dim * (1 if args.kv_dtype == "fp8"
                                                                  else 2)
        io_bytes = 2 * args.num_queries * args.head_dim * 2 * (args.q_heads + args.kv_heads)
        median = statistics.median(times)
        rows.append({"backend": backend, "config": config, "prefix": prefix,
                     "median_us": median, "min_us": min(times), "max_us": max(times),
                     "bytes": kv_bytes + io_bytes,
                     "GBps": (kv_bytes + io_bytes) / (median * 1e-6) / 1e9, "rel_err": err})
        r = rows[-1]
        print(f"{backend:10s} {config:28s} prefix={prefix:6d} median={median:8.2f}us "
              f"min={r['min_us']:7.2f} max={r['max_us']:8.2f} {r['GBps']:7.0f} GB/s "
              f"err={err:.2e}", flush=True)

    for prefix in args.prefixes:
        bench_prefix(args, prefix, env, record)
        torch.cuda.empty_cache()
        if args.out:  # after every prefix, so that a time limit keeps what was measured
            with open(args.out, "w") as f:
                json.dump({"env": env, "results": rows}, f, indent=1)

    at_4k = [r for r in rows if r["prefix"] == 4096 and r["config"] != "default eager"]
    if at_4k:
        for backend in sorted({r["backend"] for r in at_4k}):
            best = min((r for r in at_4k if r["backend"] == backend),
                       key=lambda r: r["median_us"])
            share = args.layers * best["median_us"] / (args.round_ms * 1000)
            env[f"share_of_round_at_4k_{backend}"] = {"config": best["config"],
                                                      "us_per_layer": best["median_us"],
                                                      "share": share}
            print(f"4k prefix, {backend} ({best['config']}): {best['median_us']:.2f} us/layer, "
                  f"{args.layers} layers = {100 * share:.1f}% of a {args.round_ms} ms round")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
