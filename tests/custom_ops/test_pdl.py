"""`DLMC_PDL`: the switch, the launcher, and (on CUDA) the same tokens and logits with it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from dlmc.custom_ops import _pdl
from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.errors import ConfigError


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


@pytest.mark.parametrize("value", ["2", "yes", "true", ""])
def test_bad_switch_values_are_named(monkeypatch, value):
    monkeypatch.setenv("DLMC_PDL", value)
    with pytest.raises(ConfigError, match="DLMC_PDL"):
        _pdl.pdl_mode()


def test_switch_is_off_by_default_and_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("DLMC_PDL", raising=False)
    assert _pdl.pdl_mode() == "0"
    monkeypatch.setenv("DLMC_PDL", "1")
    assert _pdl.pdl_mode() == ("0" if _pdl.INTERPRETED else "1")
    monkeypatch.setenv("DLMC_PDL", "opaque")
    assert _pdl.pdl_mode() == ("0" if _pdl.INTERPRETED else "opaque")
    assert _pdl.pdl_active(torch.device("cpu")) is False


def test_launcher_runs_kernels_with_and_without_the_parameter():
    """Off (the default), a kernel that takes PDL gets PDL=False and one that does not runs
    unchanged; a caller's own PDL value is kept (here False)."""
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
from dlmc import LLM
from dlmc.custom_ops import _pdl
llm = LLM(sys.argv[1], device="cuda", precision="nvfp4", mode="graph")
res = llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=64)
torch.save(llm.logits(res.prompt_token_ids + res.token_ids).cpu(), sys.argv[2])
print(json.dumps({"pdl": _pdl.PDL, "tokens": res.token_ids}))
"""


@pytest.mark.gpu
def test_graph_generate_equal_with_pdl_on_and_off(tmp_path):
    """A tiny NVFP4 checkpoint with an FP8 paged cache, graph mode, in two processes (the switch
    is read at import): opaque ops launched without, then with PDL give the same tokens and
    logits. Both processes share one Inductor cache, so the second replays the first's compiled
    kernels: two separate compiles of this tiny model need not agree bit for bit (session 18:
    the default's first token differed between calls), and that would hide what PDL does."""
    from dlmc.loading.tiny import write_tiny_checkpoint
    from dlmc.quant.export import export_nvfp4

    src = write_tiny_checkpoint(tmp_path / "bf16", seed=4, shards=1)
    model = tmp_path / "nvfp4"
    export_nvfp4(src, model, kv_scales={layer: (0.5, 0.25) for layer in range(3)})
    results = {}
    for flag in ("opaque", "1"):
        env = os.environ | {"DLMC_PDL": flag, "DLMC_CACHE": str(tmp_path / "cache"),
                            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
        logits_file = tmp_path / f"logits{flag}.pt"
        proc = subprocess.run([sys.executable, "-c", _GENERATE, str(model), str(logits_file)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["pdl"] is (flag == "1")
        results[flag] = (out["tokens"], torch.load(logits_file))
    assert len(results["opaque"][0]) == 64
    assert results["1"][0] == results["opaque"][0]
    assert torch.equal(results["1"][1], results["opaque"][1])


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
