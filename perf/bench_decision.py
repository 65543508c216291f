"""Time the greedy decision's row reductions: two passes against one (session 38).

The round's greedy `propose` needs, per block position, the argmax of the fp32 logits
`[32, V]` and `1 / sum(exp(logits - max))`. Up to session 37 it read the logits twice
(`row_argmax`, then `chunked_row_sum` of the exponentials: two Inductor kernels of ~11 µs each
in session 36's profile); `row_argmax_sumexp` takes each chunk's max, argmax and sum of
exponentials in one pass. Both forms are compiled (fullgraph) on the same bf16 logits, cast to
fp32 and the mask column set to -inf as `decide` does (the two-pass form at session 37's
chunking, 256 chunks; the one-pass form at each of `--widths`, `ARGMAX_CHUNK_WIDTH`), and
replayed in one CUDA graph of `--copies` calls (the logits stay in L2, as in the round, where
lm_head has just written them);
median µs per call over `--iters` replays, the kernels each form launches (profiler), and the
check that both give the same tokens and probabilities within 1e-5.

    python3 perf/bench_decision.py --out perf/results/s38/decision.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import dlmc.engine.rules as rules
from dlmc.bench.timing import graph_us
from dlmc.engine.rules import chunked_row_sum, propose, row_argmax

VOCAB = 157184  # LLaDA2.1-mini
MASK_ID = 156895


def two_pass(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Session 37's greedy `propose`: argmax, then the sum of exponentials, two reads."""
    x = logits.float()
    x[:, MASK_ID % x.shape[1]] = float("-inf")
    top, x0 = row_argmax(x)
    return x0, 1.0 / chunked_row_sum(torch.exp(x - top[:, None]))


def one_pass(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy `propose` now (`row_argmax_sumexp`)."""
    x = logits.float()
    x[:, MASK_ID % x.shape[1]] = float("-inf")
    return propose(x)


def kernels(fn, logits: torch.Tensor) -> list[str]:
    """Names of the device kernels one call of `fn` launches."""
    if not torch.cuda.is_available():
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(logits)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--widths", type=int, nargs="*",
                        help="chunk widths of the one-pass form (default: 256 chunks' width)")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=gen, device=device) * 3).to(
        torch.bfloat16)
    old_width = -(-args.vocab // 256)  # session 37's 256 chunks
    forms = [("two_pass", old_width, two_pass)] + [
        ("one_pass", width, one_pass) for width in args.widths or [old_width]]
    rows, want = {}, None
    for name, width, form in forms:
        torch._dynamo.reset()  # each form traced at its chunk width
        rules.ARGMAX_CHUNK_WIDTH = width
        fn = torch.compile(form, fullgraph=True)
        x0, p = fn(logits)
        if want is None:
            want = (x0, p)
        elif not torch.equal(x0, want[0]):
            sys.exit(f"bench_decision: {name} at width {width} chose other tokens")
        torch.testing.assert_close(p, want[1], rtol=1e-5, atol=0)
        names = kernels(fn, logits)
        us = graph_us(lambda _, f=fn: f(logits), args.copies, args.iters)
        rows[f"{name}_{width}"] = {"us_per_call": us, "kernels": names}
        print(f"{name} width {width:5d} {us:8.2f} µs per call, {len(names)} kernels: "
              f"{', '.join(names)}")
    base = rows[f"two_pass_{old_width}"]["us_per_call"]
    for key, row in rows.items():
        row["ratio"] = row["us_per_call"] / base
        print(f"{key} / two_pass_{old_width} = {row['ratio']:.3f}")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "tokens": args.tokens, "vocab": args.vocab,
              "copies": args.copies, "iters": args.iters, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
