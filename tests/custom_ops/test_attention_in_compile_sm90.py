"""`dlmc::attention_in(_append)`'s kernel compiles for sm_90 (H200) on any machine, GPU or not,
at LLaDA2.1-mini's shapes: without the append, with FP8 and BF16 pools, and with one K split
(no counter). As `test_kernels_compile_sm90.py` (whose `compile_sm90` this uses), in a
subprocess without `TRITON_INTERPRET`.
"""

from __future__ import annotations

from dlmc.custom_ops._attention_in_kernel import CONFIG, attention_in_kernel, attention_in_splits

from .test_kernels_compile_sm90 import compile_checks_pass, compile_sm90


def check_attention_in(float_type: str, kv_type: str | None, splits: int) -> None:
    """As the launcher passes the arguments (32 tokens); the PTX takes the per-head count with
    an acquire-release atomic after a barrier, its dots on tensor cores, FP8 stores rounded
    as kv_append's."""
    types = {name: "*bf16" for name in attention_in_kernel.arg_names if name.endswith("_ptr")}
    types |= {"part_ptr": "*fp32", "counter_ptr": "*i32", "page_table_ptr": "*i32",
              "offset_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
              "eps": float_type, "qk_eps": float_type}
    if kv_type is not None:
        types |= {"k_cache_ptr": kv_type, "v_cache_ptr": kv_type}
    types = {name: types.get(name, "i32") for name in attention_in_kernel.arg_names}
    _, per_split = attention_in_splits(2048)
    fp8 = kv_type == "*fp8e4nv"
    _, block_k, num_warps, num_stages = CONFIG
    compiled = compile_sm90(attention_in_kernel, types, {
        "HIDDEN": 2048, "K_PER_SPLIT": 2048 if splits == 1 else per_split, "NUM_Q": 16,
        "NUM_KV": 4, "HEAD_DIM": 128, "ROTARY": 64, "PAGE_SIZE": 16, "MAX_POS": 4096,
        "APPEND": kv_type is not None, "QUANTIZE": fp8, "EMULATE_FP8": False,
        "SPLITS": splits, "BLOCK_T": 32, "BLOCK_K": block_k, "BLOCK_STATS": 256,
        "INTERPRETED": False}, num_warps, num_stages=num_stages)
    ptx = compiled.asm["ptx"]
    assert "mma" in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (splits > 1), "the count"
    if fp8:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx


def test_attention_in_compiles_for_sm90() -> None:
    compile_checks_pass(__name__)


if __name__ == "__main__":
    check_attention_in("fp64", "*fp8e4nv", attention_in_splits(2048)[0])  # as Inductor calls it
    check_attention_in("fp32", "*bf16", attention_in_splits(2048)[0])
    check_attention_in("fp64", None, attention_in_splits(2048)[0])
    check_attention_in("fp64", None, 1)
