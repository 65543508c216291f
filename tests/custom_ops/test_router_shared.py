"""`dlmc::router_gemm_shared` and `dlmc::moe_route_shared` (`DLMC_NVFP4_SHARED=router`): the
router's two launches with the BF16 shared expert's parts as extra programs.

On CPU the kernels run under Triton's interpreter (tests/conftest.py). The routing parts give
`router_gemm` / `moe_route`'s results bit for bit; the shared rows are bit for bit the
`nvfp4_moe` op's shared pair rows (the same device functions and tiles), and within bf16
rounding of the torch SwiGLU.
"""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.moe_route import moe_route
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.route_shared import moe_route_shared, moe_route_shared_reference
from dlmc.custom_ops.router_gemm import router_gemm
from dlmc.custom_ops.router_shared import router_gemm_shared, router_gemm_shared_reference
from tests.custom_ops.test_nvfp4_moe import (
    DEVICE,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
)
from tests.custom_ops.test_nvfp4_moe_v4 import kernel_variant
from tests.custom_ops.test_router_gemm import LLADA21_MINI, make_case

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

E, H, I = 16, 128, 256  # experts (LLADA21_MINI's 8 groups of 2), hidden, expert width


def _case(tokens: int, seed: int = 3):
    """x, the router weight, the expert bias and NVFP4 experts with a BF16 shared expert."""
    x, weight = make_case(tokens, E, H, seed)
    gen = torch.Generator().manual_seed(seed)
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE)
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    ids, w = random_routing(gen, tokens, E, LLADA21_MINI[2], skew=False)
    routed = nvfp4_moe_reference(*op_args(x, ids, w, experts))
    return x, weight, bias, experts, shared_expert(gen, x, routed, H, I)


@pytest.mark.parametrize("tokens", [1, 20])
def test_routing_and_the_shared_rows_equal_the_ops(tokens: int) -> None:
    """The partials are `router_gemm`'s and the routing `moe_route`'s (torch.equal); the shared
    rows equal the op's shared pair rows (`pairs=True`, row t*(K+1) + K) bit for bit, and the
    torch SwiGLU within bf16 rounding; h within bf16 rounding of the torch h."""
    x, weight, bias, experts, shared = _case(tokens)
    partials, h = router_gemm_shared(x, weight, shared["shared_gate"], shared["shared_up"])
    assert torch.equal(partials, router_gemm(x, weight))
    _, h_ref = router_gemm_shared_reference(x, weight, shared["shared_gate"],
                                            shared["shared_up"])
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=2**-7, atol=1e-6)
    ids, w, y = moe_route_shared(partials, bias, *LLADA21_MINI, h, shared["shared_down"])
    want_ids, want_w = moe_route(partials, bias, *LLADA21_MINI)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    with kernel_variant(7):
        rows = nvfp4_moe(*op_args(x, ids, w, experts), pairs=True, **shared)
    top_k = ids.shape[1]
    assert torch.equal(y, rows.view(tokens, top_k + 1, H)[:, top_k])
    y_ref = moe_route_shared_reference(partials, bias, *LLADA21_MINI, h_ref,
                                       shared["shared_down"])[2]
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-6, atol=1e-5)


def test_bad_shared_weights_and_h_are_named() -> None:
    x, weight, bias, _, shared = _case(4)
    with pytest.raises(ValueError, match=r"router_gemm_shared: shared_up must be contiguous "
                                         r"bf16 \[256, 128\]"):
        router_gemm_shared(x, weight, shared["shared_gate"], shared["shared_up"].float())
    partials, h = router_gemm_shared(x, weight, shared["shared_gate"], shared["shared_up"])
    with pytest.raises(ValueError, match=r"moe_route_shared: shared_down must be contiguous "
                                         r"bf16 \[H, I=256\]"):
        moe_route_shared(partials, bias, *LLADA21_MINI, h, shared["shared_down"].t())
    with pytest.raises(ValueError, match=r"moe_route_shared: h must be bf16 \[T=4, I\]"):
        moe_route_shared(partials, bias, *LLADA21_MINI, h[:3], shared["shared_down"])


def check_lowering() -> None:
    """(Without the interpreter.) Both kernels compile for sm_90 at LLaDA2.1-mini shapes (32
    tokens, H 2048, I 512, 256 experts, 16 K splits), as Inductor launches them (the scaling
    factor as fp64), with BF16 tensor-core dots for the shared parts and no spills."""
    from dlmc.custom_ops import router_gemm as router
    from dlmc.custom_ops.moe_shared_parts import shared_parts, shared_split
    from dlmc.custom_ops.nvfp4_moe import shared_part_tiles
    from dlmc.custom_ops.route_shared import route_shared_kernel
    from dlmc.custom_ops.router_shared import SHARED_BLOCK_M, router_shared_kernel
    from tests.custom_ops.test_kernels_compile_sm90 import compile_sm90, resource_usage

    tiles = shared_part_tiles(2048, 512)
    block_n, splits, block_k, num_warps, num_stages = router._CONFIG
    gate_up_n, gate_up_k = tiles["gate_up"]
    compiled = compile_sm90(router_shared_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "gate_w": "*bf16",
        "up_w": "*bf16", "h_ptr": "*bf16", "tokens": "i32", "stride_x": "i32",
        "stride_h": "i32"}, {
        "N": 256, "K": 2048, "K_PER_SPLIT": router.router_splits(2048)[1], "SPLITS": splits,
        "BLOCK_T": 32, "BLOCK_N": block_n, "BLOCK_K": block_k, "I": 512,
        "PARTS": shared_parts(32, SHARED_BLOCK_M, gate_up_n), "SH_BLOCK_M": SHARED_BLOCK_M,
        "SH_BLOCK_N": gate_up_n, "SH_SPLIT": shared_split(gate_up_n), "SH_BLOCK_K": gate_up_k,
        "INTERPRETED": False}, num_warps, num_stages=num_stages)
    assert resource_usage(compiled)["LOCAL"] == 0
    assert compiled.asm["ptx"].count("mma.sync") > 0 and "cvt.rn.bf16" in compiled.asm["ptx"]
    down_n, down_k = tiles["down"]
    compiled = compile_sm90(route_shared_kernel, {
        "logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32",
        "h_ptr": "*bf16", "down_w": "*bf16", "y_ptr": "*bf16", "tokens": "i32",
        "stride_split": "i32", "stride_logits": "i32", "routed_scaling_factor": "fp64",
        "stride_h": "i32", "stride_y": "i32"}, {
        "NUM_SPLITS": splits, "NUM_EXPERTS": 256, "GROUP_SIZE": 32, "GROUPS_PAD": 8,
        "GROUP_PAD": 32, "TOPK_GROUP": 4, "TOP_K": 8, "TOP_K_PAD": 8, "NORM_TOPK_PROB": True,
        "H": 2048, "I": 512, "PARTS": shared_parts(32, SHARED_BLOCK_M, down_n),
        "SH_BLOCK_M": SHARED_BLOCK_M, "SH_BLOCK_N": down_n, "SH_SPLIT": shared_split(down_n),
        "SH_BLOCK_K": down_k, "INTERPRETED": False}, 4)
    assert resource_usage(compiled)["LOCAL"] == 0
    assert compiled.asm["ptx"].count("mma.sync") > 0


def test_the_kernels_lower_for_sm90() -> None:
    from tests.custom_ops.test_nvfp4_down_gluon import run_lowering_check

    run_lowering_check("tests.custom_ops.test_router_shared")
