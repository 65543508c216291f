"""DLMC_NVFP4_PREFETCH: compiled v5-v7 programs ask L2 for their next weight and scale runs.

The prefetch is a hint (`cp.async.bulk.prefetch.L2`): the loads after it read the same bytes
either way, so the interpreter (which cannot run it) skips it and the CPU tests of the kernels'
values hold with it on. What can be checked here is the compiled code: with the setting (read at
import, so a fresh process) each matrix gets one prefetch of weights and one of scales before
the K loop and one of each inside it, only where a program's N-tile is one run of the tiled
layout (BLOCK_N == DLMC_NVFP4_TILE_ROWS), only for v5-v7, and none without the setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECK = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dlmc.custom_ops.nvfp4_moe import _down_kernel, _gate_up_kernel

POINTERS = {"a_ptr": "*bf16", "sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32",
            "gate_w": "*u8", "gate_s": "*u8", "up_w": "*u8", "up_s": "*u8", "down_w": "*u8",
            "down_s": "*u8", "gate_alpha_ptr": "*fp32", "up_alpha_ptr": "*fp32",
            "down_alpha_ptr": "*fp32", "shared_gate_w": "*bf16", "shared_up_w": "*bf16",
            "shared_down_w": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16"}


def prefetches(kernel, variant, block_n):
    names = kernel.arg_names
    constexprs = {"H": 2048, "I": 512, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128,
                  "INTERPRETED": False, "VARIANT": variant, "SHARED": False,
                  "SHARED_BLOCK_K": 64}
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    if variant == 6:
        signature |= {n: "*i16" for n in ("gate_s", "up_s", "down_s") if n in signature}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    return ptx.count("cp.async.bulk.prefetch.L2.global")


for variant in (3, 5, 6, 7):
    print("gate_up", variant, 128, prefetches(_gate_up_kernel, variant, 128))
    print("down", variant, 128, prefetches(_down_kernel, variant, 128))
print("gate_up", 7, 64, prefetches(_gate_up_kernel, 7, 64))
"""


def _run(prefetch: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"DLMC_NVFP4_TILE_ROWS": "128", "DLMC_NVFP4_PREFETCH": prefetch,
            "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _CHECK], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)


def _counts(result: subprocess.CompletedProcess[str]) -> dict[tuple[str, int, int], int]:
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {}
    for line in result.stdout.splitlines():
        kernel, variant, block_n, count = line.split()
        counts[kernel, int(variant), int(block_n)] = int(count)
    return counts


def test_prefetch_is_compiled_in_where_a_tile_is_one_run() -> None:
    counts = _counts(_run("4"))
    for variant in (5, 6, 7):
        # two matrices x (weights + scales) x (before + in the loop); down: one matrix
        assert counts["gate_up", variant, 128] == 8, counts
        assert counts["down", variant, 128] == 4, counts
    assert counts["gate_up", 3, 128] == counts["down", 3, 128] == 0, counts  # untiled layout
    assert counts["gate_up", 7, 64] == 0, counts  # a 64-row tile is half of a 128-row run


def test_no_prefetch_by_default_and_bad_settings_are_named() -> None:
    assert set(_counts(_run("0")).values()) == {0}
    bad = _run("many")
    assert bad.returncode != 0 and "DLMC_NVFP4_PREFETCH='many'" in bad.stderr
