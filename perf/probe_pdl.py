"""Does programmatic dependent launch (PDL) shorten a chain of small kernels inside a CUDA graph?

A chain of CHAIN dependent Triton kernels (each reads the previous one's output: 32 x 2048 BF16,
the size of one block's hidden state), captured once with and once without `launch_pdl=True`,
replayed and timed with CUDA events. The PDL kernels wait (`gdc_wait`) before their first load
and let the next kernel launch (`gdc_launch_dependents`) right after. Variant `prefetch` also
loads a 64 KB constant "weight" tile per program before the wait, as a GEMM would. The outputs of
both chains are compared element for element. Also prints whether this torch's Inductor has
`config.triton.enable_pdl` (TORCHINDUCTOR_ENABLE_PDL).

    python3 perf/probe_pdl.py --out perf/results/pdl_probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _step(x_ptr, w_ptr, y_ptr, n, PDL: tl.constexpr, PREFETCH: tl.constexpr,
          BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if PREFETCH:  # a constant operand nobody writes: safe to read before the wait
        for i in tl.static_range(8):
            acc += tl.load(w_ptr + i * n + offs, mask=offs < n, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    y = x * 0.5 + 1.0 + acc * 1e-3
    tl.store(y_ptr + offs, y.to(tl.bfloat16), mask=offs < n)


def chain(x, w, bufs, steps, pdl, prefetch):
    n = x.numel()
    block = 512
    src = x
    for i in range(steps):
        dst = bufs[i % 2]
        _step[(triton.cdiv(n, block),)](src, w, dst, n, PDL=pdl, PREFETCH=prefetch,
                                        BLOCK=block, launch_pdl=pdl)
        src = dst
    return src


def time_graph(fn, reps: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import torch._inductor.config as icfg
        inductor_pdl = hasattr(icfg.triton, "enable_pdl")
    except Exception:  # noqa: BLE001 - only reported
        inductor_pdl = False
    n = 32 * 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(8 * n, device="cuda", generator=g).to(torch.bfloat16)
    result = {"torch": torch.__version__, "triton": triton.__version__,
              "gpu": torch.cuda.get_device_name(), "chain": args.chain,
              "inductor_enable_pdl": inductor_pdl, "runs": {}}
    outs = {}
    for prefetch in (False, True):
        for pdl in (False, True):
            bufs = [torch.empty_like(x), torch.empty_like(x)]
            name = f"{'prefetch' if prefetch else 'plain'}_{'pdl' if pdl else 'serial'}"
            times = time_graph(functools.partial(chain, x, w, bufs, args.chain, pdl, prefetch),
                               args.reps)
            outs[name] = chain(x, w, bufs, args.chain, pdl, prefetch).clone()
            med = statistics.median(times)
            result["runs"][name] = {"median_us": med, "min_us": min(times), "max_us": max(times),
                                    "us_per_kernel": med / args.chain}
            print(f"{name:18s} median {med:9.1f} us  ({med / args.chain:.2f} us/kernel)  "
                  f"min {min(times):.1f} max {max(times):.1f}")
    for kind in ("plain", "prefetch"):
        same = torch.equal(outs[f"{kind}_serial"], outs[f"{kind}_pdl"])
        result[f"{kind}_outputs_equal"] = same
        print(f"{kind}: PDL output equals serial output: {same}")
    print(f"inductor config.triton.enable_pdl present: {inductor_pdl}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
