"""`DLMC_NVFP4_RING_EMPTY`: how the Gluon NVFP4 kernels' consumer warps hand ring slots back
(`_nvfp4_gluon_ring`).

On CPU: a bad value is named; in "named" mode every Gluon kernel form still lowers for sm_90
within its registers (the down and fused kernels' own lowering checks, in a subprocess with the
switch set), the consumers arrive with `bar.arrive` on barriers 8.. counting 160 threads, the
producer waits there with `bar.sync`, no barrier id of Triton's own reaches 8, and in the SASS
each arrival comes before the slot's MMAs. On the H200,
the Gluon kernels' GPU tests pass in "named" mode (bit for bit the Triton kernels; a missing
or extra arrival would hang them, so they run under a timeout).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton

from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_gluon_ring, _nvfp4_moe_gluon
from tests.custom_ops.test_nvfp4_down_gluon import (
    compile_gluon_sm90,
    down_types,
    run_lowering_check,
)
from tests.custom_ops.test_nvfp4_moe_gluon import fused_types

NAMED = {"DLMC_NVFP4_RING_EMPTY": "named"}


def test_a_bad_value_names_the_switch() -> None:
    env = os.environ | {"DLMC_NVFP4_RING_EMPTY": "spin"}
    result = subprocess.run([sys.executable, "-c", "import dlmc.custom_ops._nvfp4_gluon_ring"],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "DLMC_NVFP4_RING_EMPTY='spin': expected named or mbarrier" in result.stderr


def test_the_default_is_the_mbarrier() -> None:
    if "DLMC_NVFP4_RING_EMPTY" not in os.environ:
        assert _nvfp4_gluon_ring.RING_EMPTY == "mbarrier"
        assert not _nvfp4_gluon_ring.NAMED_EMPTY


def check_named_ring() -> None:
    """(Run with the switch on "named".) The gate/up-only form of the fused kernel and the
    down kernel with tickets: the consumers' `bar.arrive` and the producer's `bar.sync` on a
    register id, both counting 160 threads (4 consumer warps and the producer warp); no mbarrier
    arrival without expected bytes is left on the consumer side; Triton's own barriers use
    immediate ids below `EMPTY_BARRIER`."""
    assert _nvfp4_gluon_ring.NAMED_EMPTY
    forms = (  # (the fused kernel's down items read a slot in two steps: the first step's
        # MMAs may come before the slot's arrival, so only the read-back is checked there)
        (_nvfp4_moe_gluon._moe_gluon_kernel, fused_types(), _nvfp4_moe_gluon.MAXNREG,
         {"STAGES": _nvfp4_moe_gluon.STAGES, "H": 2048, "I": 512, "BLOCK_M": 16,
          "PDL_ENTER": True, "PDL_AFTER": False, "TICKETS": 0, "X_TMA": True}),
        (_nvfp4_down_gluon._down_gluon_kernel, down_types(), _nvfp4_down_gluon.MAXNREG,
         {"STAGES": _nvfp4_down_gluon.STAGES, "KSTEPS": 4, "TILES": 16, "I": 512, "H": 2048,
          "BLOCK_M": 16, "OVERLAP": True, "PDL": True, "TICKETS": True, "PER_PART": True}),
    )
    for (kernel, types, maxnreg, consts), strict in zip(forms, (False, True), strict=True):
        compiled, usage = compile_gluon_sm90(kernel, types, consts, maxnreg)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
        ptx = compiled.asm["ptx"]
        arrives = re.findall(r"bar\.arrive (%r\d+), (\d+);", ptx)
        syncs = re.findall(r"bar\.sync (%r\d+), (\d+);", ptx)
        assert arrives and syncs, kernel.fn.__name__
        assert {count for _, count in arrives + syncs} == {"160"}
        # the consumers' mbarrier arrivals on `empty` are gone (left: the end tag's arrival on
        # `ready` and the copies' expect-tx arrivals)
        assert ptx.count("mbarrier.arrive.shared::cta.b64 _") == 1, kernel.fn.__name__
        own = [int(n) for n in re.findall(r"\bbar(?:rier)?\.sync\s+(\d+)", ptx)]
        assert own and max(own) < _nvfp4_gluon_ring.EMPTY_BARRIER, own
        # in the SASS: no MMA between a slot's proxy fence and its arrival, and the zero read
        # back after the arrival before the next MMA (which decodes with it). The down kernel:
        # every arrival; the fused kernel: its gate/up items' (its down items read a slot in
        # two steps, and the first step's MMAs may move across the arrival)
        ops = [op for op in map(_opcode, _sass(compiled).splitlines()) if op]
        arrivals = [n for n, op in enumerate(ops) if op == "BAR.ARV"]
        assert len(arrivals) == ptx.count("bar.arrive"), kernel.fn.__name__
        pinned = [_pinned(ops, n) for n in arrivals]
        assert all(pinned) if strict else any(pinned), (kernel.fn.__name__, pinned)


def _pinned(ops: list[str], n: int) -> bool:
    """Whether arrival `ops[n]` follows the last proxy fence before it with no MMA between,
    and a shared-memory load comes after it before the next MMA."""
    fence = max(m for m in range(n) if ops[m] == "FENCE.VIEW.ASYNC.S")
    after = ops[n + 1:]
    first_mma = next(m for m, op in enumerate(after) if op.startswith("HMMA"))
    return (not any(op.startswith("HMMA") for op in ops[fence:n])
            and any(op.startswith("LDS") for op in after[:first_mma]))

def _sass(compiled: object) -> str:
    """The SASS of a compiled kernel (Triton's cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout


def _opcode(line: str) -> str:
    """The opcode of a SASS instruction line (after its predicate), or ""."""
    match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return match.group(1) if match else ""


def test_named_mode_lowers_for_sm90() -> None:
    run_lowering_check("tests.custom_ops.test_nvfp4_gluon_ring", "check_named_ring", NAMED)
    run_lowering_check("tests.custom_ops.test_nvfp4_down_gluon", env=NAMED)
    run_lowering_check("tests.custom_ops.test_nvfp4_moe_gluon", env=NAMED)


@pytest.mark.gpu
def test_named_mode_gluon_kernels_gpu() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    files = [f"tests/custom_ops/test_nvfp4_{name}_gluon.py" for name in ("down", "gate_up", "moe")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                             "no:cacheprovider", *files], env=os.environ | NAMED,
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b\d+ passed", result.stdout) and " failed" not in result.stdout
