"""Programmatic dependent launch: the launcher, and (on CUDA) the same tokens with it on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher, pdl_enter


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)


@triton.jit
def _add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


def test_launcher_runs_kernels_with_and_without_the_parameter():
    """A kernel that takes PDL gets PDL=False unless the caller passes one, and one that does
    not runs unchanged; a caller's own PDL value is kept (here False)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(100, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    launcher(_scale_kernel)[(4,)](x, y, 100, FACTOR=3.0, BLOCK=32)
    assert torch.equal(y, x * 3.0)
    launcher(_scale_kernel)[(4,)](x, y, 100, FACTOR=0.5, BLOCK=32, PDL=False)
    assert torch.equal(y, x * 0.5)
    launcher(_add_kernel)[(4,)](x, y, 100, BLOCK=32)
    assert torch.equal(y, x + 1.0)
    assert launcher(_scale_kernel).takes_pdl and not launcher(_add_kernel).takes_pdl


_GENERATE = """
import json, sys, torch
from dlmc import KernelConfig, LLM
llm = LLM(sys.argv[1], device="cuda", precision="nvfp4", mode="graph",
          kernels=KernelConfig(pdl=sys.argv[3] == "1", deterministic_compile=True))
res = llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=64)
torch.save(llm.logits(res.prompt_token_ids + res.token_ids).cpu(), sys.argv[2])
print(json.dumps({"pdl": llm.kernels.pdl, "tokens": res.token_ids}))
"""


@pytest.mark.gpu
def test_graph_generate_equal_with_pdl_on_and_off(tmp_path):
    """A tiny NVFP4 checkpoint with an FP8 paged cache, graph mode, in two processes:
    `KernelConfig(pdl=False)` and the default give the same tokens and logits (PDL changes
    when kernels start, never what they compute). Each config compiles into its own Inductor
    cache (the compile-cache key); deterministic compiles keep timing-based kernel choices from
    telling the two apart."""
    from dlmc.loading.tiny import write_tiny_checkpoint
    from dlmc.quant.export import export_nvfp4

    src = write_tiny_checkpoint(tmp_path / "bf16", seed=4, shards=1)
    model = tmp_path / "nvfp4"
    export_nvfp4(src, model, kv_scales={layer: (0.5, 0.25) for layer in range(3)})
    results = {}
    for flag in ("0", "1"):
        env = os.environ | {"DLMC_CACHE": str(tmp_path / "cache")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        logits_file = tmp_path / f"logits{flag}.pt"
        proc = subprocess.run([sys.executable, "-c", _GENERATE, str(model), str(logits_file),
                               flag], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["pdl"] is (flag == "1")
        results[flag] = (out["tokens"], torch.load(logits_file))
    assert len(results["0"][0]) == 64
    assert results["1"][0] == results["0"][0]
    torch.testing.assert_close(results["1"][1], results["0"][1], rtol=2e-2, atol=2e-2)


@triton.jit
def _defaults_kernel(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 3, C: tl.constexpr = False):
    pass


def test_traced_launches_get_every_default():
    """Inductor's trace needs every constexpr passed: the launcher adds the defaults the call
    leaves out (positional or keyword), and keeps what it gives."""
    from dlmc.custom_ops._pdl import with_defaults

    assert with_defaults(_defaults_kernel, ("x", 4), {"A": 1}) == {"A": 1, "B": 3, "C": False}
    assert with_defaults(_defaults_kernel, ("x", 4, 1, 5), {}) == {"C": False}
    assert with_defaults(_defaults_kernel, ("x",), {"n": 2, "A": 1, "C": True}) == {
        "n": 2, "A": 1, "B": 3, "C": True}
