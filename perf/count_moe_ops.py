"""Ops in the traced graph of one MoE layer, with the routing prep as torch ops vs the
`dlmc::moe_align` kernel, and with the router's top-k as torch ops vs the `dlmc::moe_route` kernel;
with both kernels, the shared expert fused (`fuse_shared_expert`) as a dense tail of the op
(`shared_expert=True`) vs as a materialised `[T, K+1]` column (the cats before the op). CPU only:
the layer is traced on fake tensors (no kernel runs), with the `dlmc::bf16_moe` body that a GPU
compile sees (router, routing prep, the two grouped kernels, combine, shared expert).

    env -u TRITON_INTERPRET python perf/count_moe_ops.py --shape llada2.1-mini --tokens 32
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dlmc.custom_ops import bf16_moe, moe_align, moe_route
from dlmc.custom_ops.moe_align import append_shared_column
from dlmc.loading.tiny import TINY_CONFIG
from dlmc.models import moe
from dlmc.models.config import LLaDA2Config
from dlmc.models.moe import MoEBlock
from dlmc.models.shapes import SHAPES

# Ops that launch nothing (metadata, allocation) are listed but not counted as kernels.
NO_KERNEL = {"aten.view.default", "aten.unsqueeze.default", "aten.expand.default",
             "aten.empty.memory_format", "aten.t.default", "aten.permute.default",
             "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten.detach.default",
             "aten._unsafe_view.default", "<built-in function getitem>"}


def trace_moe_layer(config: LLaDA2Config, tokens: int, kernel: bool, route_kernel: bool = False,
                    fused: str | None = None) -> collections.Counter:
    """Op counts of `MoEBlock.forward` with `dlmc::bf16_moe`'s body inlined; `fused`: None (shared
    expert separate), "dense_tail" or "column" (fused, see the module docstring)."""
    originals = moe_align._kernel_applies, moe.moe_route_reference
    # Fake CPU tensors stand for CUDA ones: the kernel path is chosen by the size limits alone.
    moe_align._kernel_applies = lambda ids, experts: kernel and (
        ids.numel() <= moe_align.MAX_KERNEL_PAIRS and experts <= moe_align.MAX_KERNEL_EXPERTS)
    if route_kernel:  # the Router's CUDA path; the op's body is traced (as Inductor does)
        moe.moe_route_reference = lambda logits, bias, *args: moe_route._moe_route_impl(
            logits, bias, *args)
    default_dtype = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)
            block = MoEBlock(config)  # the router's weight and expert_bias stay fp32
            x = torch.empty(tokens, config.hidden_size, dtype=torch.bfloat16)
            if fused:
                block.fuse_shared_expert()
            experts = block.experts

            def layer(x: torch.Tensor) -> torch.Tensor:
                topk_ids, topk_weights = block.gate(x)
                if fused == "column":
                    topk_ids = append_shared_column(topk_ids, block.shared_expert_id)
                    topk_weights = append_shared_column(topk_weights, 1.0)
                routed = bf16_moe._bf16_moe_impl(
                    x, topk_ids, topk_weights.float(), experts.gate_proj_weight,
                    experts.up_proj_weight, experts.down_proj_weight, fused == "dense_tail")
                return routed if fused else routed + block.shared_experts(x)

            graph = make_fx(layer)(x)
    finally:
        moe_align._kernel_applies, moe.moe_route_reference = originals
        torch.set_default_dtype(default_dtype)
    return collections.Counter(str(node.target) for node in graph.graph.nodes
                               if node.op == "call_function")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llada2.1-mini", choices=[*SHAPES, "tiny"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET (the interpreted ops are opaque)")
    config = LLaDA2Config.from_dict(TINY_CONFIG) if args.shape == "tiny" else SHAPES[args.shape]
    result = {"shape": args.shape, "tokens": args.tokens, "torch": torch.__version__}
    variants = (("torch_routing", False, False, None), ("moe_align_kernel", True, False, None),
                ("moe_align_and_moe_route_kernels", True, True, None),
                ("fused_shared_expert_column", True, True, "column"),
                ("fused_shared_expert_dense_tail", True, True, "dense_tail"))
    for name, kernel, route_kernel, fused in variants:
        ops = trace_moe_layer(config, args.tokens, kernel, route_kernel, fused)
        result[name] = {"ops": sum(ops.values()),
                        "kernel_ops": sum(n for op, n in ops.items() if op not in NO_KERNEL),
                        "by_op": dict(sorted(ops.items()))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
