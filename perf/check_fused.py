"""One `nvfp4_moe` call at LLaDA2.1-mini shapes (32 tokens x top-8 of 256 experts, shared
expert optional) with the fused Gluon kernel (`DLMC_NVFP4_DOWN=fused`) at the given programs
per SM, against the Triton kernels: prints the programs per SM the occupancy calculator allows
and whether the outputs are equal bit for bit. Run each setting in its own process with a
timeout: a kernel whose programs wait for programs that cannot be resident hangs.

    PYTHONPATH=. timeout 60 python3 perf/check_fused.py --per-sm 3 [--shared]
"""

from __future__ import annotations

import argparse
import time

import torch

from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_moe_gluon
from dlmc.custom_ops.moe_align import route_block_m
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.test_nvfp4_moe import (
    op_args,
    random_experts,
    random_routing,
    shared_expert,
)
from tests.custom_ops.test_nvfp4_moe_v4 import bits, kernel_variant
from tests.custom_ops.test_nvfp4_moe_v5 import stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-sm", type=int, default=_nvfp4_moe_gluon.PROGRAMS_PER_SM)
    parser.add_argument("--stages", type=int, default=_nvfp4_moe_gluon.STAGES)
    parser.add_argument("--shared", action="store_true")
    parser.add_argument("--shape", default="256,2048,512,32,8",
                        help="experts,hidden,inter,tokens,top_k (default LLaDA2.1-mini's)")
    parser.add_argument("--skew", action="store_true", help="every token on the first experts")
    parser.add_argument("--tickets", action="store_true", help="items by the ticket counter")
    args = parser.parse_args()
    _nvfp4_moe_gluon.PROGRAMS_PER_SM, _nvfp4_moe_gluon.STAGES = args.per_sm, args.stages
    _nvfp4_moe_gluon.TICKETS = args.tickets
    gen = torch.Generator().manual_seed(4)
    E, H, I, T, K = (int(v) for v in args.shape.split(","))
    experts = {k: v.cuda() for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    ids, w = random_routing(gen, T, E, K, skew=args.skew)
    shared = {}
    if args.shared:
        shared = shared_expert(gen, x, nvfp4_moe_reference(*op_args(x, ids, w, experts)), H, I)
    call = op_args(x, ids, w, stored(experts, 7))
    with kernel_variant(7):
        expected = nvfp4_moe(*call, **shared)
        _nvfp4_down_gluon.MODE = "fused"
        start = time.perf_counter()
        out = nvfp4_moe(*call, **shared)
        print(f"per_sm asked {args.per_sm}, stages {args.stages}, shared {args.shared}, "
              f"tickets {args.tickets}: "
              f"launched with {list(_nvfp4_moe_gluon._PROGRAMS.values())} programs", flush=True)
        torch.cuda.synchronize()
    ref = nvfp4_moe_reference(*op_args(x, ids, w, experts), **shared).float()
    scale = ref.abs().amax().item()
    print(f"{time.perf_counter() - start:.2f} s; block_m {route_block_m(T, K, E, bool(shared))}; "
          f"equal {torch.equal(bits(out), bits(expected))}; max |fused - triton| / max|ref| "
          f"{(out.float() - expected.float()).abs().amax().item() / scale:.3e}; "
          f"max |fused - ref| / max|ref| {(out.float() - ref).abs().amax().item() / scale:.3e}; "
          f"max |triton - ref| / max|ref| "
          f"{(expected.float() - ref).abs().amax().item() / scale:.3e}", flush=True)
    if not torch.equal(bits(out), bits(expected)) and route_block_m(T, K, E, bool(shared)) < 64:
        raise SystemExit("the fused kernel's output differs from the Triton kernels'")


if __name__ == "__main__":
    main()
