"""`moe_overlap`: `nvfp4_moe`'s down programs waiting per slot for the gate/up programs, and the
op's `pdl` argument.

On CPU the interpreter runs the gate/up launch to its end before the down launch, so every wait
is satisfied on arrival: these tests check that the counted launches (`pdl=True`: slot-major
grids, the signals, the waits, the last reader's reset) give the plain launches' output
(`pdl=False`) bit for bit and leave every counter zero. The GPU test runs them with PDL, where
the waits really wait.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops import moe_overlap
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    bits,
    counters_zero,
    kernel_v3,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
    stored,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _outputs(monkeypatch: pytest.MonkeyPatch, seed: int, tokens: int, num_experts: int,
             top_k: int, hidden: int, inter: int, shared: bool, skew: bool = False,
             pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The op with `pdl=False` and `pdl=True` (same inputs), checking which one counts."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    args = op_args(x, ids, w, experts)
    extra = shared_expert(gen, x, x, hidden, inter) if shared else {}
    counted: list[int] = []
    real = launch.counters
    monkeypatch.setattr(launch, "counters",
                        lambda device, slots: counted.append(slots) or real(device, slots))
    plain = nvfp4_moe(*args, **extra, pairs=pairs, pdl=False)
    assert not counted
    out = nvfp4_moe(*args, **extra, pairs=pairs)
    assert len(counted) == 1
    return plain, out


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 5, 17, 40]),
       num_experts=st.integers(1, 6), top_k=st.integers(1, 3), shared=st.booleans(),
       skew=st.booleans(), shape=st.sampled_from([(32, 48), (64, 16), (48, 32)]))
def test_counted_launches_equal_the_plain_ones(monkeypatch: pytest.MonkeyPatch, seed: int,
                                               tokens: int, num_experts: int, top_k: int,
                                               shared: bool, skew: bool,
                                               shape: tuple[int, int]) -> None:
    """Several N-tiles per slot, experts with no tokens, the shared expert's chunks."""
    plain, counted = _outputs(monkeypatch, seed, tokens, num_experts, min(top_k, num_experts),
                              *shape, shared, skew)
    assert torch.equal(bits(counted), bits(plain))
    assert counters_zero(counted.device)


@pytest.mark.parametrize("shared", [False, True])
def test_tiled_layout_with_counters(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """The default kernel (v7; its tiled layout at a 256 x 128 shape), 2 x 2 tiles per slot,
    and kernel v3 at the same shape; the pair rows too."""
    plain, counted = _outputs(monkeypatch, 5, 17, 5, 2, 256, 128, shared)
    assert torch.equal(bits(counted), bits(plain))
    with kernel_v3():
        plain, counted = _outputs(monkeypatch, 5, 17, 5, 2, 256, 128, shared, pairs=True)
    assert torch.equal(bits(counted), bits(plain))
    assert counters_zero(counted.device)


def test_counter_buffer_is_kept_and_grows() -> None:
    device = torch.device(DEVICE)
    moe_overlap._COUNTERS.pop(device, None)
    first = moe_overlap.counters(device, 10)
    assert first.numel() >= 20 and first.dtype == torch.int32 and not first.any()
    assert moe_overlap.counters(device, 100).data_ptr() == first.data_ptr()
    bigger = moe_overlap.counters(device, first.numel())
    assert bigger.numel() >= 2 * first.numel() and moe_overlap._COUNTERS[device] is bigger


def test_counters_where_pdl_is_and_under_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdl=True`: the counters under the interpreter and on sm_90+, PDL launches only there;
    `pdl=False`: neither."""
    cpu = torch.device("cpu")
    assert moe_overlap.overlap_active(cpu, True) == moe_overlap.INTERPRETED
    assert not moe_overlap.overlap_pdl(cpu, True)  # no PDL on a CPU, interpreted or not
    assert not (moe_overlap.overlap_active(cpu, False) or moe_overlap.overlap_pdl(cpu, False))
    monkeypatch.setattr(moe_overlap, "INTERPRETED", False)
    assert not moe_overlap.overlap_active(cpu, True)
    monkeypatch.setattr(moe_overlap, "device_has_pdl", lambda device: True)
    assert moe_overlap.overlap_active(cpu, True) and moe_overlap.overlap_pdl(cpu, True)
    assert not (moe_overlap.overlap_active(cpu, False) or moe_overlap.overlap_pdl(cpu, False))


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
    ids = torch.tensor([[0, 2], [1, 2]])
    moe_align.route_pairs(ids, 4, False, pdl)
    y, weights = torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(2, 2)
    moe_combine.combine_pairs(y, weights, torch.empty(2, 8, dtype=torch.bfloat16), False, pdl)
    for recorder in recorders.values():
        (kwargs,) = recorder.launches
        assert (kwargs.get("PDL"), kwargs.get("launch_pdl")) == ((True, True) if pdl
                                                                 else (None, None))
        assert "num_warps" in kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 128])
def test_pdl_gives_the_plain_output_gpu(tokens: int) -> None:
    """`pdl=True` (PDL: the waits really wait, down starts during gate/up; the alignment and
    combine launched with PDL; the Gluon kernels where they apply) against `pdl=False`,
    LLaDA2.1-mini expert shapes with the shared expert (at 32 tokens its items: equal up to
    their summation order; at 128 in the routing: bit for bit), 20 eager calls and 20 graph
    replays, each bit for bit the first call."""
    gen = torch.Generator().manual_seed(3)
    experts = stored(random_experts(gen, 64, 2048, 512))  # as loaded: no conversion per call
    x = torch.randn(tokens, 2048, generator=gen).bfloat16().cuda()
    ids, w = random_routing(gen, tokens, 64, 8, False)
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, x, 2048, 512)
    for pdl in (False, True):
        outs = [nvfp4_moe(*args, **shared, pdl=pdl) for _ in range(20)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = nvfp4_moe(*args, **shared, pdl=pdl)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(replayed), bits(outs[0]))
        assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
        assert counters_zero(x.device) or not pdl
        if not pdl:
            plain = outs[0]
    if tokens > 32:
        assert torch.equal(bits(outs[0]), bits(plain))
    else:
        torch.testing.assert_close(outs[0].float(), plain.float(), rtol=2**-6,
                                   atol=2**-6 * float(plain.float().abs().amax()))
