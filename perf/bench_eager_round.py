"""Baseline: one eager denoising round of LLaDA2.1-mini at full size (random weights), BF16.

A round = forward of a 32-token block against a KV cache holding a 1024-token prefix, then the
commit/edit decision. Usage (on a GPU machine):

    python perf/bench_eager_round.py --prefix 1024 --block-length 32 --rounds 30 --out perf/x.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from dlmc.engine.attention import CachedAttention
from dlmc.engine.kv_cache import DenseKVCache
from dlmc.engine.rules import joint_threshold_step, propose
from dlmc.models.moe import Router
from dlmc.models.shapes import SHAPES, build_random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llada2.1-mini", choices=sorted(SHAPES))
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = SHAPES[args.shape]
    model = build_random_model(cfg, device, dtype, seed=0)
    cache = DenseKVCache(
        cfg.num_hidden_layers,
        args.prefix + args.block_length,
        cfg.num_key_value_heads,
        cfg.head_dim,
        dtype,
        device,
    )
    for pool in (*cache.k, *cache.v):
        pool.normal_()
    touched: list[int] = []
    original = Router.forward

    def recording(self, x):  # count distinct experts each layer's tokens route to
        ids, w = original(self, x)
        touched.append(int(ids.unique().numel()))
        return ids, w

    Router.forward = recording
    gen = torch.Generator(device=device).manual_seed(0)
    block = torch.randint(0, cfg.vocab_size, (args.block_length,), device=device, generator=gen)
    pos = torch.arange(args.prefix, args.prefix + args.block_length, device=device)
    editable = torch.ones(args.block_length, dtype=torch.bool, device=device)
    times = []
    with torch.inference_mode():
        for i in range(args.rounds + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = model(block, pos, CachedAttention(cache, args.prefix, store=True))
            x0, p = propose(logits)
            active = block < 0  # all decoded: edit-only round
            block, _, _ = joint_threshold_step(block, x0, p, active, editable, 0.85, 0.5)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
            block = torch.randint(
                0, cfg.vocab_size, (args.block_length,), device=device, generator=gen
            )
    Router.forward = original
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    experts_per_layer = statistics.mean(touched[-moe_layers:])
    result = {
        "mode": "eager",
        "shape": args.shape,
        "precision": "bf16",
        "block_length": args.block_length,
        "prefix": args.prefix,
        "rounds": args.rounds,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "distinct_experts_per_moe_layer": experts_per_layer,
        "routing": "model (random weights)",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
