"""The GPU variants of the kernels compile for sm_90 (H200) on any machine, GPU or not.

The CPU tests run the kernels under Triton's interpreter, which takes other code paths (while
loops, fp32 dots, emulated FP8 rounding); this compiles the real ones ahead of time with Triton's
bundled ptxas, including the fp64 scalar that Inductor passes for Python floats. It runs in a
subprocess without `TRITON_INTERPRET` (under the interpreter `triton.jit` makes no JITFunction).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from dlmc.custom_ops._paged_attention_kernels import (
    paged_attention_split_kernel,
    split_launch_config,
)
from dlmc.custom_ops._paged_attention_launch import append_tile_tokens
from dlmc.custom_ops._paged_attention_merge import (
    flat_merge_config,
    merge_chunk,
    paged_attention_merge_flat_kernel,
    paged_attention_merge_kernel,
)
from dlmc.custom_ops.bf16_moe import _DEFAULT_LAUNCH
from dlmc.custom_ops.bf16_moe import _down_kernel as bf16_down_kernel
from dlmc.custom_ops.bf16_moe import _gate_up_kernel as bf16_gate_up_kernel
from dlmc.custom_ops.kv_append import kv_append_kernel
from dlmc.custom_ops.moe_align import align_pairs_of_expert, aligned_blocks, moe_align_kernel

SM90 = GPUTarget("cuda", 90, 32)
ROOT = Path(__file__).resolve().parents[2]  # the repository root (`python -m tests....`)


def compile_sm90(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object],
                 num_warps: int, divisible: tuple[str, ...] = (),
                 **options: object) -> triton.compiler.CompiledKernel:
    """`divisible`: arguments the launcher would mark 16-divisible (as it does at run time).
    Kernels that take `PDL` compile as launched with PDL unless `constexprs` says otherwise:
    their PTX must then wait for the previous grid (griddepcontrol); `nvfp4_moe`'s down kernel
    with `OVERLAP` waits per slot instead. `nvfp4_moe`'s `moe_overlap` parameters and its
    Gluon-down forms (`H_EVEN_ODD`, `PARTS_ONLY`) default to off, its `ACTIVATION` to SiLU;
    `dlmc::paged_attention`'s `WINDOW_PER_QUERY` to off."""
    names = kernel.arg_names
    if "PDL" in names and "PDL" not in constexprs:
        constexprs = constexprs | {"PDL": True}
    defaults = {"OVERLAP": False, "GATE_UP_TILES": 1, "GATE_UP_SPLIT": 1, "H_EVEN_ODD": False,
                "PARTS_ONLY": False, "ACTIVATION": "silu", "WINDOW_PER_QUERY": False}
    constexprs = {k: v for k, v in defaults.items() if k in names} | constexprs
    signature = {name: "constexpr" if name in constexprs else types[name] for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=SM90, options={"num_warps": num_warps, **options})
    if constexprs.get("PDL"):
        ptx = compiled.asm["ptx"]
        slot_waits = constexprs.get("OVERLAP") and "GATE_UP_TILES" in names
        assert ("griddepcontrol.wait" in ptx) != slot_waits
        assert "griddepcontrol.launch_dependents" in ptx
    return compiled


SPLIT_ARGS = paged_attention_split_kernel.arg_names
# as the launcher specializes them for LLaDA2.1-mini shapes: pointers, strides, sizes
SPLIT_DIVISIBLE = tuple(name for name in SPLIT_ARGS if name.endswith("_ptr") or "stride" in name
                        or name in ("num_queries", "num_rows", "max_tokens"))


def split_types(kv_type: str, part_type: str, float_type: str) -> dict[str, str]:
    """Argument types of the split kernel: caches `kv_type`, partials `part_type`."""
    pointers = {"q_ptr": "*bf16", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
                "k_cache_ptr": kv_type, "v_cache_ptr": kv_type, "page_table_ptr": "*i32",
                "prefix_len_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                "o_part_ptr": part_type, "lse_part_ptr": "*fp32", "scale_log2": float_type}
    return {name: pointers.get(name, "i32") for name in SPLIT_ARGS}


def merge_types(kernel: triton.JITFunction, partial: str = "*fp32") -> dict[str, str]:
    """A merge kernel's argument types: `partial` outputs, fp32 LSEs, a BF16 output."""
    pointers = {"o_part_ptr": partial, "lse_part_ptr": "*fp32", "out_ptr": "*bf16",
                "prefix_len_ptr": "*i32"}
    return {name: pointers.get(name, "i32") for name in kernel.arg_names}


def compile_flat_merge(head_dim: int, group: int, splits: int, block_n: int, partial: str,
                       interleaved: bool, speculative: bool, rows: int,
                       pdl: bool) -> triton.compiler.CompiledKernel:
    """The flat merge as `launch_paged_attention` launches it (`flat_merge_config`'s warps)."""
    chunk, merge_warps = flat_merge_config(splits, rows, head_dim)
    return compile_sm90(paged_attention_merge_flat_kernel,
                        merge_types(paged_attention_merge_flat_kernel, partial), {
                            "GROUP": group, "HEAD_DIM": head_dim, "NUM_SPLITS": splits,
                            "MIN_SPLIT_KEYS": 128, "BLOCK_N": block_n,
                            "INTERLEAVED": interleaved, "SPECULATIVE": speculative,
                            "ROWS": rows, "CHUNK": chunk, "PDL": pdl},
                        merge_warps, **({"launch_pdl": True} if pdl else {}))


def check_split_and_merge(float_type: str, head_dim: int, kv_type: str,
                          causal_block: int) -> None:
    block_m, block_n, num_warps = split_launch_config(head_dim)
    types = split_types(kv_type, "*fp32", float_type)
    num_stages = 3 if head_dim <= 128 else 2
    default = {
        "GROUP": 4, "HEAD_DIM": head_dim, "PAGE_SIZE": 16, "CAUSAL_BLOCK": causal_block,
        "NUM_SPLITS": 33, "MIN_SPLIT_KEYS": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "DOT_FP32": False, "LOOP_WHILE": False, "NUM_STAGES": num_stages, "WINDOWED": False,
        "INTERLEAVED": False, "DOT_F16": False, "PDL": False, "OWN_STAGES": num_stages,
        "SPEC_TILES": 1, "APPEND": False, "APPEND_T": 1, "EMULATE_FP8": False}
    compiled = compile_sm90(paged_attention_split_kernel, types, default, num_warps)
    assert "cp.async" in compiled.asm["ptx"]  # the key loop is software-pipelined
    compile_sm90(paged_attention_merge_kernel, merge_types(paged_attention_merge_kernel), {
        "GROUP": 4, "HEAD_DIM": head_dim, "NUM_SPLITS": 33, "MIN_SPLIT_KEYS": 128,
        "BLOCK_N": block_n, "CHUNK": 32, "LOOP_WHILE": False}, 4)


def check_variants(head_dim: int, kv_type: str, windowed: bool) -> None:
    """The perf/bench_paged_attention.py --sweep variants' code paths (PagedAttentionVariant)."""
    block_m, block_n, num_warps = split_launch_config(head_dim)
    types = split_types(kv_type, "*bf16", "fp64")
    compiled = compile_sm90(paged_attention_split_kernel, types, {
        "GROUP": 4, "HEAD_DIM": head_dim, "PAGE_SIZE": 16, "CAUSAL_BLOCK": 0,
        "NUM_SPLITS": 32, "MIN_SPLIT_KEYS": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "DOT_FP32": False, "LOOP_WHILE": False, "NUM_STAGES": 3, "WINDOWED": windowed,
        "INTERLEAVED": True, "DOT_F16": kv_type == "*fp8e4nv", "PDL": True, "OWN_STAGES": 1,
        "SPEC_TILES": 2, "APPEND": False, "APPEND_T": 1, "EMULATE_FP8": False}, num_warps,
        SPLIT_DIVISIBLE)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "cp.async" in ptx
    if head_dim == 128:  # one own-loop stage: 64 KB of shared memory, 3 programs per SM
        assert compiled.metadata.shared <= 66 * 1024, compiled.metadata.shared
    for speculative, rows in ((False, 1), (True, 4)):
        compiled = compile_flat_merge(head_dim, 4, 32, block_n, "*bf16", interleaved=True,
                                      speculative=speculative, rows=rows, pdl=True)
        assert "griddepcontrol.wait" in compiled.asm["ptx"]
        assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def ptxas_usage(compiled: triton.compiler.CompiledKernel) -> tuple[int, int]:
    """(registers, spill store bytes) that Triton's bundled ptxas reports for the kernel."""
    ptx = compiled.asm["ptx"]
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", path, "-o",
                                 os.devnull], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    return registers, int(re.search(r"(\d+) bytes spill stores", report).group(1))


def check_appending_split(head_dim: int, kv_type: str, interleaved: bool,
                          causal_block: int = 0) -> None:
    """`dlmc::paged_attention_append`'s split kernel (APPEND) as the launcher specializes it
    (the CUDA default variant of the cache type): the kv_append rounding, no spills, and at
    most 8 registers more than the pure kernel (161-184 at D=128: perf/paged_attention.md)."""
    block_m, block_n, num_warps = split_launch_config(head_dim)
    types = split_types(kv_type, "*fp32", "fp64")
    num_stages = 3 if head_dim <= 128 else 2
    usage = {}
    for append in (False, True):
        compiled = compile_sm90(paged_attention_split_kernel, types, {
            "GROUP": 4, "HEAD_DIM": head_dim, "PAGE_SIZE": 16, "CAUSAL_BLOCK": causal_block,
            "NUM_SPLITS": 32 if interleaved else 33, "MIN_SPLIT_KEYS": 128, "BLOCK_M": block_m,
            "BLOCK_N": block_n, "DOT_FP32": False, "LOOP_WHILE": False,
            "NUM_STAGES": num_stages, "WINDOWED": False, "INTERLEAVED": interleaved,
            "DOT_F16": False, "PDL": False, "OWN_STAGES": 1 if interleaved else num_stages,
            "SPEC_TILES": 2 if interleaved else 1, "APPEND": append,
            "APPEND_T": append_tile_tokens(head_dim), "EMULATE_FP8": False},
            num_warps, SPLIT_DIVISIBLE)
        usage[append] = ptxas_usage(compiled)
    ptx = compiled.asm["ptx"]
    if kv_type == "*fp8e4nv":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    (pure, pure_spills), (fused, fused_spills) = usage[False], usage[True]
    assert pure_spills == fused_spills == 0, usage
    assert fused <= pure + 8, usage


def check_diffusiongemma_attention() -> None:
    """The split and merge kernels as DiffusionGemma's layers launch them on an H200 (the
    default contiguous variant at D = 256 and 512, 2 stages, scale from Inductor in fp64,
    `default_num_splits` for 132 SMs): the canvas of the decoder (256 queries, bidirectional;
    sliding layers windowed: D 256, 2 query heads per KV head; full layers: D 512, 8 per KV
    head) and an encoder chunk (causal; sliding layers with the per-query window), FP8 and BF16
    caches, the encoder's BF16 forms also appending; then both merges, the flat speculative
    one (the default at these head dims) without spills. The split kernel's registers and
    spills are printed for the record (not checked: no measured baseline yet)."""
    for layer, head_dim, group, kv_heads in (("sliding", 256, 2, 8), ("full", 512, 8, 2)):
        block_m, block_n, num_warps = split_launch_config(head_dim)
        splits = math.ceil(2 * 132 / (math.ceil(256 * group / block_m) * kv_heads))
        windowed = layer == "sliding"
        for kv_type in ("*fp8e4nv", "*bf16"):
            passes = [(False, False), (True, False)] + [(True, True)] * (kv_type == "*bf16")
            for encoder, append in passes:
                form = (layer, kv_type, "encoder" if encoder else "decoder", append)
                compiled = compile_sm90(paged_attention_split_kernel,
                                        split_types(kv_type, "*fp32", "fp64"), {
                    "GROUP": group, "HEAD_DIM": head_dim, "PAGE_SIZE": 16,
                    "CAUSAL_BLOCK": int(encoder), "NUM_SPLITS": splits, "MIN_SPLIT_KEYS": 128,
                    "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_FP32": False,
                    "LOOP_WHILE": False, "NUM_STAGES": 2, "WINDOWED": windowed,
                    "INTERLEAVED": False, "DOT_F16": False, "PDL": False, "OWN_STAGES": 2,
                    "SPEC_TILES": 1, "APPEND": append, "APPEND_T": append_tile_tokens(head_dim),
                    "EMULATE_FP8": False, "WINDOW_PER_QUERY": encoder and windowed},
                    num_warps, SPLIT_DIVISIBLE)
                registers, spills = ptxas_usage(compiled)
                print(f"paged_attention DiffusionGemma {form}: {registers} registers, "
                      f"{spills} bytes spilled, smem {compiled.metadata.shared}")
                assert "cp.async" in compiled.asm["ptx"], form  # the key loop is pipelined
        compile_sm90(paged_attention_merge_kernel, merge_types(paged_attention_merge_kernel),
                     {"GROUP": group, "HEAD_DIM": head_dim, "NUM_SPLITS": splits,
                      "MIN_SPLIT_KEYS": 128, "BLOCK_N": block_n, "CHUNK": merge_chunk(splits),
                      "LOOP_WHILE": False}, 4 if head_dim <= 256 else 8)
        # the default merge at these head dims: flat, speculative, over contiguous splits
        compiled = compile_flat_merge(head_dim, group, splits, block_n, "*fp32",
                                      interleaved=False, speculative=True, rows=1, pdl=False)
        registers, spills = ptxas_usage(compiled)
        print(f"paged_attention DiffusionGemma {layer} flat merge: {registers} registers, "
              f"{spills} bytes spilled")
        assert spills == 0, (layer, registers, spills)


def check_kv_append() -> None:
    pointers = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
                "v_cache_ptr": "*fp8e4nv", "page_table_ptr": "*i32", "offset_ptr": "*i32",
                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    types = {name: pointers.get(name, "i32") for name in kv_append_kernel.arg_names}
    compiled = compile_sm90(kv_append_kernel, types, {
        "HEAD_DIM": 128, "PAGE_SIZE": 16, "MAX_TOKENS": 4096, "QUANTIZE": True,
        "EMULATE_FP8": False, "BLOCK_T": 16}, 4)
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx


def resource_usage(compiled: triton.compiler.CompiledKernel) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL (spills) of a compiled kernel's cubin (Triton's cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def check_moe_align(tokens: int, top_k: int, num_experts: int, block_m: int, num_warps: int,
                    shared_expert: bool = False, per_expert: bool = False) -> None:
    """`per_expert`: the kernel of one program per expert (its last argument `num_experts`)."""
    types = {"ids_ptr": "*i64", "sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32",
             "num_pairs": "i32", "top_k": "i32", "shared_expert": "i32", "num_experts": "i32"}
    kernel = align_pairs_of_expert if per_expert else moe_align_kernel
    types = {name: types[name] for name in kernel.arg_names if name in types}
    log_pairs_pad = max(4, (tokens * top_k - 1).bit_length())
    compiled = compile_sm90(kernel, types, {
        "NUM_BLOCKS": aligned_blocks(tokens, top_k, num_experts, block_m, shared_expert),
        "BLOCK_M": block_m, "LOG_PAIRS_PAD": log_pairs_pad,
        "EXPERTS_PAD": max(16, 1 << (num_experts - 1).bit_length()),
        "SHARED_BLOCKS": -(-tokens // block_m) if shared_expert else 0, "FILL": 1024}, num_warps)
    assert compiled.metadata.shared <= 48 * 1024  # one program, no opt-in shared memory needed
    assert resource_usage(compiled)["LOCAL"] == 0  # no spills


def check_bf16_moe(hidden: int, inter: int, block_m: int) -> None:
    """`dlmc::bf16_moe`'s two kernels as launched (PDL, the default tiles), gate/up with each
    activation: no spills."""
    pointers = {"a_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "gate_w": "*bf16",
                "up_w": "*bf16", "down_w": "*bf16", "sorted_pair_ptr": "*i32",
                "expert_of_block_ptr": "*i32"}
    for kernel, tiles, extra in ((bf16_gate_up_kernel, "gate_up", ("silu", "gelu_tanh")),
                                 (bf16_down_kernel, "down", (None,))):
        n, k, warps, stages = _DEFAULT_LAUNCH[tiles]
        types = {name: pointers.get(name, "i32") for name in kernel.arg_names}
        for activation in extra:
            constexprs = {"H": hidden, "I": inter, "BLOCK_M": block_m, "BLOCK_N": n,
                          "BLOCK_K": k, "INTERPRETED": False}
            if activation:
                constexprs["ACTIVATION"] = activation
            compiled = compile_sm90(kernel, types, constexprs, warps, num_stages=stages)
            usage = resource_usage(compiled)
            print(f"bf16_moe {tiles} {activation or ''} H {hidden} I {inter}: {usage}")
            assert usage["LOCAL"] == 0


def check_canvas_propose() -> None:
    """`dlmc::canvas_propose`'s two kernels at DiffusionGemma's vocabulary (8192-entry chunks
    of 1024-entry tiles; bf16 and fp32 self-conditioning output, with and without kept rows;
    capped fp32 logits, or bf16 values capped inside with libdevice's tanh, the cap an fp64 as
    Inductor passes a Python float, or a float constant as Inductor's mutation analysis passes
    it; the default tiles): IEEE division for `logits / T`, no spills."""
    from dlmc.custom_ops.canvas_propose import (
        DEFAULT_TILES,
        propose_chunk_kernel,
        propose_merge_kernel,
    )

    chunk, block, warps = DEFAULT_TILES.chunk, DEFAULT_TILES.block, DEFAULT_TILES.num_warps
    for sc_type, keep, logits in (("*bf16", True, "*bf16"), ("*fp32", False, "*fp32")):
        pointers = {"logits_ptr": logits, "noise_ptr": "*fp32", "temp_ptr": "*fp32",
                    "sc_ptr": sc_type, "keep_ptr": "*i1", "stats_ptr": "*fp32",
                    "idx_ptr": "*i32", "softcap": "fp64" if keep else "fp32"}  # Inductor: fp64
        types = {name: pointers.get(name, "i32") for name in propose_chunk_kernel.arg_names}
        compiled = compile_sm90(propose_chunk_kernel, types, {
            "HAS_KEEP": keep, "SOFTCAP": logits == "*bf16", "SC_BF16": sc_type == "*bf16",
            "CHUNK": chunk, "BLOCK": block, "INTERPRETED": False}, warps)
        assert "div.rn.f32" in compiled.asm["ptx"]
        assert resource_usage(compiled)["LOCAL"] == 0
    # Inductor's analysis of which tensors the kernel writes compiles it with the cap as a
    # Python float constant; a failure there makes Inductor treat every input as written
    compile_sm90(propose_chunk_kernel, types, {
        "HAS_KEEP": False, "SOFTCAP": True, "SC_BF16": False, "CHUNK": chunk, "BLOCK": block,
        "INTERPRETED": False, "softcap": 30.0}, warps)
    types = {"stats_ptr": "*fp32", "idx_ptr": "*i32", "sample_ptr": "*i64", "argmax_ptr": "*i64",
             "entropy_ptr": "*fp32", "num_chunks": "i32"}
    compile_sm90(propose_merge_kernel, types, {"CHUNKS_PAD": 32}, 1)


def compile_checks_pass(module: str) -> None:
    """Run `module`'s `__main__` (its sm_90 compile checks) with `python -m` from the
    repository root, without `TRITON_INTERPRET`; assert it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                            text=True, timeout=600, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_kernels_compile_for_sm90() -> None:
    compile_checks_pass(__name__)


if __name__ == "__main__":
    check_split_and_merge("fp64", 128, "*fp8e4nv", 0)  # as Inductor calls it
    check_split_and_merge("fp32", 256, "*fp8e4nv", 0)  # as an eager call does
    check_split_and_merge("fp32", 512, "*bf16", 4)
    check_variants(128, "*fp8e4nv", windowed=False)
    check_variants(256, "*bf16", windowed=True)
    check_variants(512, "*fp8e4nv", windowed=True)
    check_appending_split(128, "*fp8e4nv", interleaved=True)  # the CUDA FP8 default (ilv32)
    check_appending_split(128, "*bf16", interleaved=False)  # the CUDA BF16 default (base)
    check_appending_split(512, "*fp8e4nv", interleaved=False, causal_block=32)  # prefill chunk
    check_diffusiongemma_attention()
    check_kv_append()
    from tests.custom_ops.nvfp4_compile_checks import check_nvfp4_moe

    check_nvfp4_moe()  # every kernel form dlmc::nvfp4_moe launches
    check_bf16_moe(2048, 512, 16)  # LLaDA2.1-mini's experts
    check_bf16_moe(2816, 704, 16)  # DiffusionGemma's, a 256-token canvas (route_block_m)
    check_moe_align(32, 8, 256, 16, 4)  # a diffusion block
    check_moe_align(32, 8, 256, 16, 4, shared_expert=True)  # ... with the shared expert fused
    check_moe_align(512, 8, 16, 64, 8, per_expert=True)  # a prefill chunk
    check_moe_align(512, 8, 256, 32, 8, shared_expert=True, per_expert=True)
    check_moe_align(256, 8, 128, 16, 4, per_expert=True)  # DiffusionGemma's canvas
    check_canvas_propose()
