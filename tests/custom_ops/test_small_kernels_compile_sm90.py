"""The small round kernels compile for sm_90 (H200) on any machine, GPU or not: the q/k norm +
rope (bf16 qkv and split-K partials) with and without the KV append, the rope tables, the
routing kernels, the router and small-M GEMMs, the fused post-attention ops. As
`test_kernels_compile_sm90.py` (whose `compile_sm90` this uses), in a subprocess without
`TRITON_INTERPRET`.
"""

from __future__ import annotations

from dlmc.custom_ops.linear_residual import BLOCK_N as SUM_TILE
from dlmc.custom_ops.linear_residual import linear_residual_kernel
from dlmc.custom_ops.moe_route import moe_route_kernel
from dlmc.custom_ops.norm_router_gemm import norm_router_gemm_kernel
from dlmc.custom_ops.qk_norm_rope import _qk_norm_rope_kernel
from dlmc.custom_ops.qk_norm_rope_append import qk_norm_rope_append_kernel
from dlmc.custom_ops.rope_tables import rope_tables_kernel
from dlmc.custom_ops.router_gemm import _CONFIG as ROUTER_GEMM_CONFIG
from dlmc.custom_ops.router_gemm import router_gemm_kernel, router_splits
from dlmc.custom_ops.split_k_linear import _CONFIG as SPLIT_K_LINEAR_CONFIG
from dlmc.custom_ops.split_k_linear import linear_splits

from .test_kernels_compile_sm90 import compile_checks_pass, compile_sm90


def check_qk_norm_rope(float_type: str, splits: int) -> None:
    """qkv bf16 (`splits` 0) or split-K's fp32 partials (summed as read)."""
    pointers = {name: "*bf16" for name in ("qkv_ptr", "q_w_ptr", "k_w_ptr", "cos_ptr", "sin_ptr",
                                           "q_ptr", "k_ptr", "v_ptr")}
    types = pointers | {"eps": float_type, "stride_t": "i32", "stride_s": "i32",
                        "qkv_ptr": "*fp32" if splits else "*bf16"}
    compile_sm90(_qk_norm_rope_kernel, types, {
        "NUM_Q": 16, "NUM_KV": 4, "HEAD_DIM": 128, "ROTARY": 64, "SPLITS": splits}, 1)


def check_rope_tables() -> None:
    compiled = compile_sm90(rope_tables_kernel, {
        "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
        {"HALF": 32, "HALF_PAD": 32, "INTERPRETED": False}, 1)
    ptx = compiled.asm["ptx"]
    # cos/sin are libdevice's (eager PyTorch's cosf/sinf), not the approximate PTX instructions
    assert "cos.approx" not in ptx and "sin.approx" not in ptx


def check_qk_norm_rope_append(float_type: str, kv_type: str, splits: int) -> None:
    """`dlmc::qk_norm_rope_append` as its launcher passes the arguments: qk_norm_rope's, the
    pools `kv_type`, the page table, offset and scales, int strides; the FP8 store rounds as
    kv_append's does. qkv bf16 (`splits` 0) or split-K's fp32 partials."""
    pointers = {name: "*bf16" for name in ("qkv_ptr", "q_w_ptr", "k_w_ptr", "cos_ptr", "sin_ptr",
                                           "q_ptr", "k_ptr", "v_ptr")}
    pointers["qkv_ptr"] = "*fp32" if splits else "*bf16"
    types = pointers | {"k_cache_ptr": kv_type,
                        "v_cache_ptr": kv_type, "page_table_ptr": "*i32", "offset_ptr": "*i32",
                        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "eps": float_type}
    types = {name: types.get(name, "i32") for name in qk_norm_rope_append_kernel.arg_names}
    fp8 = kv_type == "*fp8e4nv"
    compiled = compile_sm90(qk_norm_rope_append_kernel, types, {
        "NUM_Q": 16, "NUM_KV": 4, "HEAD_DIM": 128, "ROTARY": 64, "PAGE_SIZE": 16,
        "MAX_TOKENS": 4096, "QUANTIZE": fp8, "EMULATE_FP8": False, "SPLITS": splits}, 1)
    ptx = compiled.asm["ptx"]
    if fp8:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx


def check_moe_route(float_type: str, splits: int) -> None:
    types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64",
             "weights_ptr": "*fp32", "stride_split": "i32", "stride_logits": "i32",
             "routed_scaling_factor": float_type}
    compile_sm90(moe_route_kernel, types, {
        "NUM_SPLITS": splits, "NUM_EXPERTS": 256, "GROUP_SIZE": 32, "GROUPS_PAD": 8,
        "GROUP_PAD": 32, "TOPK_GROUP": 4, "TOP_K": 8, "TOP_K_PAD": 8, "NORM_TOPK_PROB": True}, 4)


# The arguments both fused routing kernels share (besides their token count or ticket).
def check_router_gemm() -> None:
    """The router's fp32 GEMM on BF16 tensor cores: three mma per tile, no TF32."""
    types = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "tokens": "i32",
             "stride_x": "i32"}
    block_n, _, block_k, num_warps, _ = ROUTER_GEMM_CONFIG
    for block_t in (16, 32, 64):
        compiled = compile_sm90(router_gemm_kernel, types, {
            "N": 256, "K": 2048, "K_PER_SPLIT": router_splits(2048)[1], "BLOCK_T": block_t,
            "BLOCK_N": block_n, "BLOCK_K": block_k, "INTERPRETED": False,
            "BF16_WEIGHT": False}, num_warps)
        ptx = compiled.asm["ptx"]
        assert "mma" in ptx and ".bf16" in ptx and "tf32" not in ptx
        assert "cvt.rn.bf16" in ptx  # the weight split rounds to nearest even
    # dlmc::split_k_linear: bf16 weights, one dot, no split of the weight
    block_n, _, block_k, num_warps, num_stages = SPLIT_K_LINEAR_CONFIG
    ptx = compile_sm90(router_gemm_kernel, types | {"w_ptr": "*bf16"}, {
        "N": 2048, "K": 2048, "K_PER_SPLIT": linear_splits(2048)[1], "BLOCK_T": 32,
        "BLOCK_N": block_n, "BLOCK_K": block_k, "INTERPRETED": False, "BF16_WEIGHT": True},
        num_warps, num_stages=num_stages).asm["ptx"]
    assert "mma" in ptx and "cvt.rn.bf16" not in ptx


def check_post_attention() -> None:
    """`dlmc::linear_residual` (split_k_linear's dot, then the tile's ticket: a gpu-scope
    atomic) and `dlmc::norm_router_gemm` (the norm, then the router's split dots) at
    LLaDA2.1-mini's shapes, launched with PDL."""
    block_n, _, block_k, num_warps, num_stages = SPLIT_K_LINEAR_CONFIG
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "res_ptr": "*bf16", "part_ptr": "*fp32",
             "h_ptr": "*bf16", "ss_ptr": "*fp32", "ticket_ptr": "*i32", "tokens": "i32",
             "stride_x": "i32", "stride_r": "i32"}
    splits, per_split = linear_splits(2048)
    ptx = compile_sm90(linear_residual_kernel, types, {
        "N": 2048, "K": 2048, "K_PER_SPLIT": per_split, "SPLITS": splits, "BLOCK_T": 32,
        "BLOCK_N": block_n, "BLOCK_K": block_k, "INTERPRETED": False},
        num_warps, num_stages=num_stages).asm["ptx"]
    assert "mma" in ptx and "atom.global.gpu.acq_rel.add" in ptx
    block_n, _, block_k, num_warps, _ = ROUTER_GEMM_CONFIG
    types = {"h_ptr": "*bf16", "ss_ptr": "*fp32", "nw_ptr": "*bf16", "w_ptr": "*fp32",
             "xn_ptr": "*bf16", "part_ptr": "*fp32", "tokens": "i32", "eps": "fp32",
             "stride_h": "i32"}
    ptx = compile_sm90(norm_router_gemm_kernel, types, {
        "N": 256, "K": 2048, "K_PER_SPLIT": router_splits(2048)[1], "TILES": 2048 // SUM_TILE,
        "BLOCK_TILES": 2048 // SUM_TILE, "BLOCK_T": 32, "BLOCK_N": block_n,
        "BLOCK_K": block_k, "INTERPRETED": False}, num_warps).asm["ptx"]
    assert "mma" in ptx and "cvt.rn.bf16" in ptx and "tf32" not in ptx


def test_small_kernels_compile_for_sm90() -> None:
    compile_checks_pass(__name__)


if __name__ == "__main__":
    check_qk_norm_rope("fp64", 0)  # Inductor passes Python floats as fp64
    check_qk_norm_rope("fp32", 0)
    check_qk_norm_rope("fp64", 4)  # qkv from split_k_linear
    check_rope_tables()
    check_qk_norm_rope_append("fp64", "*fp8e4nv", 0)  # as Inductor calls it
    check_qk_norm_rope_append("fp32", "*bf16", 0)
    check_qk_norm_rope_append("fp64", "*fp8e4nv", 4)
    check_moe_route("fp64", 1)
    check_moe_route("fp32", 8)  # router_gemm's split-K partials
    check_router_gemm()
    check_post_attention()
