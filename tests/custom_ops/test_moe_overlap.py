"""`moe_overlap`: `nvfp4_moe`'s down programs waiting per slot for the gate/up programs.

On CPU the interpreter runs the gate/up launch to its end before the down launch, so every wait
is satisfied on arrival: these tests check that the counted launches (slot-major grids, the
signals, the waits, the last reader's reset) give the uncounted launches' output bit for bit
and leave every counter zero. The GPU test runs them with PDL, where the waits really wait.
`DLMC_NVFP4_OVERLAP` is read at import; the tests patch `moe_overlap.MODE`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import moe_overlap
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe
from dlmc.errors import ConfigError
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    bits,
    kernel_v3,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
)
from tests.loading.test_nvfp4_loading import graph_results_by_switch

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _outputs(monkeypatch: pytest.MonkeyPatch, seed: int, tokens: int, num_experts: int,
             top_k: int, hidden: int, inter: int, shared: bool, skew: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op without and with the counters (same inputs)."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    args = op_args(x, ids, w, experts)
    extra = shared_expert(gen, x, x, hidden, inter) if shared else {}
    monkeypatch.setattr(moe_overlap, "MODE", "0")
    plain = nvfp4_moe(*args, **extra)
    monkeypatch.setattr(moe_overlap, "MODE", "1")
    assert moe_overlap.overlap_active(x.device)
    return plain, nvfp4_moe(*args, **extra)


def _counters_zero(device: torch.device) -> bool:
    held = moe_overlap._COUNTERS.get(device)
    return held is not None and not bool(held.any())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 5, 17, 40]),
       num_experts=st.integers(1, 6), top_k=st.integers(1, 3), shared=st.booleans(),
       skew=st.booleans(), shape=st.sampled_from([(32, 48), (64, 16), (48, 32)]))
def test_counted_launches_equal_the_plain_ones(monkeypatch: pytest.MonkeyPatch, seed: int,
                                               tokens: int, num_experts: int, top_k: int,
                                               shared: bool, skew: bool,
                                               shape: tuple[int, int]) -> None:
    """Several N-tiles per slot, experts with no tokens, the shared expert's chunks."""
    with kernel_v3():
        plain, counted = _outputs(monkeypatch, seed, tokens, num_experts,
                                  min(top_k, num_experts), *shape, shared, skew)
    assert torch.equal(bits(counted), bits(plain))
    assert _counters_zero(counted.device)


@pytest.mark.parametrize("shared", [False, True])
def test_tiled_layout_with_counters(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """The default kernel (v7; its tiled layout at a 256 x 128 shape), 2 x 2 tiles per slot."""
    plain, counted = _outputs(monkeypatch, 5, 17, 5, 2, 256, 128, shared)
    assert torch.equal(bits(counted), bits(plain))
    assert _counters_zero(counted.device)


def test_counter_buffer_is_kept_and_grows() -> None:
    device = torch.device(DEVICE)
    moe_overlap._COUNTERS.pop(device, None)
    first = moe_overlap.counters(device, 10)
    assert first.numel() >= 20 and first.dtype == torch.int32 and not first.any()
    assert moe_overlap.counters(device, 100).data_ptr() == first.data_ptr()
    bigger = moe_overlap.counters(device, first.numel())
    assert bigger.numel() >= 2 * first.numel() and moe_overlap._COUNTERS[device] is bigger


@pytest.mark.parametrize("value", ["2", "on", "auto", ""])
def test_bad_switch_values_are_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DLMC_NVFP4_OVERLAP", value)
    with pytest.raises(ConfigError, match="DLMC_NVFP4_OVERLAP"):
        moe_overlap._mode()


def test_on_by_default_where_pdl_is_and_under_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLMC_NVFP4_OVERLAP", raising=False)
    assert moe_overlap._mode() == "1"
    monkeypatch.setattr(moe_overlap, "MODE", "1")
    cpu = torch.device("cpu")
    assert moe_overlap.overlap_active(cpu) == moe_overlap.INTERPRETED
    assert not moe_overlap.overlap_pdl(cpu)  # no PDL on a CPU, interpreted or not
    monkeypatch.setattr(moe_overlap, "INTERPRETED", False)
    assert not moe_overlap.overlap_active(cpu)
    monkeypatch.setattr(moe_overlap, "INTERPRETED", True)
    monkeypatch.setattr(moe_overlap, "MODE", "0")
    assert not moe_overlap.overlap_active(cpu)


@pytest.mark.parametrize("value", ["2", "on", ""])
def test_bad_edge_switch_values_are_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DLMC_NVFP4_PDL_EDGES", value)
    with pytest.raises(ConfigError, match="DLMC_NVFP4_PDL_EDGES"):
        moe_overlap._edges()


def test_edge_pdl_needs_the_switch_and_the_counted_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLMC_NVFP4_PDL_EDGES", raising=False)
    assert moe_overlap._edges() is True  # on by default
    monkeypatch.setenv("DLMC_NVFP4_PDL_EDGES", "0")
    assert moe_overlap._edges() is False
    cpu = torch.device("cpu")
    monkeypatch.setattr(moe_overlap, "EDGES", True)
    assert not moe_overlap.edge_pdl(cpu)  # no PDL on a CPU
    monkeypatch.setattr(moe_overlap, "overlap_pdl", lambda device: True)
    assert moe_overlap.edge_pdl(cpu)
    monkeypatch.setattr(moe_overlap, "EDGES", False)
    assert not moe_overlap.edge_pdl(cpu)


class _Recorder:
    """A `launcher` stand-in: records each launch's keyword arguments, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[dict[str, object]] = []

    def __call__(self, kernel: object) -> _Recorder:
        return self

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("pdl", [False, True])
def test_edge_launches_ask_for_pdl(monkeypatch: pytest.MonkeyPatch, pdl: bool) -> None:
    """`route_pairs(..., pdl)` and `combine_pairs(..., pdl)` pass the PDL launch options to
    their kernels when compiled, and nothing else changes in the launch."""
    from dlmc.custom_ops import moe_align, moe_combine

    recorders = {}
    for module in (moe_align, moe_combine):
        recorders[module] = _Recorder()
        monkeypatch.setattr(module, "launcher", recorders[module])
        monkeypatch.setattr(module, "_INTERPRETED", False)
    monkeypatch.setattr(moe_align, "_kernel_applies", lambda ids, experts: True)
    monkeypatch.setattr(moe_combine, "COMBINE", "triton")
    ids = torch.tensor([[0, 2], [1, 2]])
    moe_align.route_pairs(ids, 4, False, pdl)
    y, weights = torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(2, 2)
    moe_combine.combine_pairs(y, weights, torch.empty(2, 8, dtype=torch.bfloat16), False, pdl)
    for recorder in recorders.values():
        (kwargs,) = recorder.launches
        assert (kwargs.get("PDL"), kwargs.get("launch_pdl")) == ((True, True) if pdl
                                                                 else (None, None))
        assert "num_warps" in kwargs


_GPU_SCRIPT = r"""
import json, sys, torch
from dlmc.custom_ops import moe_overlap
from tests.custom_ops.nvfp4_cases import op_args, random_experts, random_routing, shared_expert
from tests.custom_ops.nvfp4_cases import stored
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe
gen = torch.Generator().manual_seed(3)
experts = stored(random_experts(gen, 64, 2048, 512))  # as loaded: no conversion per call
x = torch.randn(32, 2048, generator=gen).bfloat16().cuda()
ids, w = random_routing(gen, 32, 64, 8, False)
args = op_args(x, ids, w, experts)
shared = shared_expert(gen, x, x, 2048, 512)
outs = [nvfp4_moe(*args, **shared) for _ in range(20)]
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    replayed = nvfp4_moe(*args, **shared)
for _ in range(20):
    graph.replay()
torch.cuda.synchronize()
held = moe_overlap._COUNTERS.get(x.device)
print(json.dumps({"overlap": moe_overlap.overlap_pdl(x.device),
                  "edges": moe_overlap.edge_pdl(x.device),
                  "out": outs[0].view(torch.int16).flatten().tolist(),
                  "repeat_equal": all(torch.equal(o, outs[0]) for o in outs),
                  "graph_equal": torch.equal(replayed, outs[0]),
                  "counters_zero": held is None or not bool(held.any())}))
"""


@pytest.mark.gpu
def test_overlap_with_pdl_gives_the_plain_output_gpu() -> None:
    """`DLMC_NVFP4_OVERLAP=1` (PDL: the waits really wait, down starts during gate/up), also
    with `DLMC_NVFP4_PDL_EDGES=1` (the alignment and combine launched with PDL), against `0`,
    LLaDA2.1-mini expert shapes with the shared expert, 20 eager calls and 20 graph replays
    each, bit for bit."""
    results = {}
    for overlap, edges in (("0", "0"), ("1", "0"), ("1", "1")):
        env = dict(os.environ, DLMC_PDL="0", DLMC_NVFP4_OVERLAP=overlap,
                   DLMC_NVFP4_PDL_EDGES=edges)
        done = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"OVERLAP={overlap} EDGES={edges}: {done.stderr[-3000:]}"
        results[overlap + edges] = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["overlap"], r["edges"]) for r in results.values()] == [
        (False, False), (True, False), (True, True)]
    for result in results.values():
        assert result["repeat_equal"] and result["graph_equal"] and result["counters_zero"]
    assert results["10"]["out"] == results["00"]["out"] == results["11"]["out"]


@pytest.mark.gpu
def test_graph_rounds_equal_with_the_waits_on_and_off(nvfp4_dir, monkeypatch):
    """A tiny NVFP4 model in graph mode (the op opaque inside Inductor's graph, its kernels
    launched with PDL and the counters): the tokens and logits of the plain launches."""
    assert moe_overlap.OPAQUE_OP  # the default registration
    results = graph_results_by_switch(nvfp4_dir, monkeypatch, "DLMC_NVFP4_OVERLAP", ("0", "1"),
                                      moe_overlap, "MODE")
    assert results["1"][0] == results["0"][0]
    assert torch.equal(results["1"][1], results["0"][1])
