"""Benchmark DiffusionGemma's dense matrix products alone at the canvas's 256 rows.

Each product of the denoising step outside the experts and attention (q/k/v fused, o_proj,
the dense MLP's fused gate/up and down, the router, the self-conditioning MLP, the lm_head
and the self-conditioning product over the vocabulary), on as many distinct bf16 weights as
the step has layers of it (so they stream from memory as in the step), captured in one CUDA
graph; µs per product = replay median / copies, through aten (cuBLAS, as the step runs
them). The last line sums the products as the step runs them (µs x copies).

    python perf/bench_dense.py --out /tmp/dense.json
    python perf/bench_dense.py --only qkv_sliding lm_head
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from dlmc.bench.timing import copy_bandwidth_gbps, graph_us
from dlmc.models.diffusion_gemma_config import FULL, SLIDING
from dlmc.models.shapes import DIFFUSIONGEMMA_26B_A4B as CONFIG


def products() -> list[tuple[str, int, int, int, bool]]:
    """(name, K, N, copies, transposed) of each product of the step: `x[canvas, K] @ W.T`
    with W [N, K] where `transposed` (nn.Linear), else `x @ W` with W [K, N]; `copies`: how
    many the step runs (one per layer; the self-conditioning MLP's gate and up: two)."""
    c, h = CONFIG, CONFIG.hidden_size
    sliding, full = c.layer_types.count(SLIDING), c.layer_types.count(FULL)
    q_s, kv_s = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    q_f, k_f = c.num_attention_heads * c.global_head_dim, (c.num_global_key_value_heads
                                                           * c.global_head_dim)
    layers, inter, vocab = c.num_hidden_layers, c.intermediate_size, c.vocab_size
    return [("qkv_sliding", h, q_s + 2 * kv_s, sliding, True),
            ("qkv_full", h, q_f + k_f, full, True),
            ("o_sliding", q_s, h, sliding, True), ("o_full", q_f, h, full, True),
            ("mlp_gate_up", h, 2 * inter, layers, True), ("mlp_down", inter, h, layers, True),
            ("router", h, c.num_experts, layers, True),
            ("self_cond_gate_up", h, inter, 2, True), ("self_cond_down", inter, h, 1, True),
            ("lm_head", h, vocab, 1, True), ("self_cond_vocab", vocab, h, 1, False)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--canvas", type=int, default=CONFIG.canvas_length)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", nargs="*", default=None, help="product names to time")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args()


def product(transposed: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ (w.t() if transposed else w)
    return mm


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth_gbps()
    results, step_us = {}, 0.0
    for name, k, n, copies, transposed in products():
        if args.only is not None and name not in args.only:
            continue
        x = torch.randn(args.canvas, k, device="cuda", generator=gen).bfloat16()
        shape = (n, k) if transposed else (k, n)
        weights = [(torch.randn(shape, device="cuda", generator=gen) * k ** -0.5).bfloat16()
                   for _ in range(copies)]
        nbytes = 2 * (n * k + args.canvas * (k + n))
        flops = 2 * args.canvas * k * n
        mm = product(transposed)
        us = graph_us(lambda i, mm=mm, x=x, w=weights: mm(x, w[i]), copies, args.iters)
        step_us += us * copies
        results[name] = {"k": k, "n": n, "copies": copies, "bytes": nbytes, "flops": flops,
                         "us": us, "tflops": flops / us / 1e6,
                         "of_copy": nbytes / (copy * 1e3) / us}
        print(f"{name:17s} {k:6d}->{n:6d} x{copies:2d} {us:8.1f} µs "
              f"{flops / us / 1e6:6.0f} TFLOP/s {100 * results[name]['of_copy']:5.1f} % of copy")
        del weights
    print(f"all products as the step runs them: {step_us:.1f} µs per step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"canvas": args.canvas, "copy_gbps": copy, "products": results,
                       "step_us": step_us,
                       "device": torch.cuda.get_device_name()}, f, indent=2)


if __name__ == "__main__":
    main()
