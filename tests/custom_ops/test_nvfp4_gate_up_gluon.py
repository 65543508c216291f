"""`nvfp4_moe`'s routed gate/up in the Gluon kernel (`_nvfp4_gate_up_gluon`), then the Gluon down
kernel, where they apply with `pdl=True`; and the op's plan (`_nvfp4_moe_launch._plan`).

On CPU: which kernels each call runs, how many programs fit on an SM, and the op's wiring with
both Gluon launches replaced by torch computations (the down stand-in checks the per-part
counts). The kernels' sm_90 lowering is checked in test_kernels_compile_sm90.py. On the H200
the op's output equals the Triton kernels' (`pdl=False`) bit for bit, eager and replayed in a
CUDA graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dlmc.custom_ops import _nvfp4_gate_up_gluon, _nvfp4_self_route
from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops._nvfp4_gluon_reference import gate_up_gluon_reference
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    against_plain,
    assert_matches_reference,
    counters_zero,
    gluon_on_cpu,
    op_args,
    random_experts,
    random_routing,
)
from tests.custom_ops.test_nvfp4_down_gluon import assert_graph_replays_like_triton, torch_down

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (T, H, I, E, shared, pdl, w4a4) -> (variant, overlap, launch_pdl, items, in_routing, block_m,
# gluon_down, gluon_gate_up, no_align), as on an H200 (K = 8)
PLANS = {
    "llada_shared": ((32, 2048, 512, 256, True, True, False),
                     (7, True, True, True, False, 16, True, True, True)),
    "llada": ((32, 2048, 512, 256, False, True, False),
              (7, True, True, False, False, 16, True, True, True)),
    "33_tokens_shared": ((33, 2048, 512, 256, True, True, False),
                         (7, True, True, False, True, 16, True, False, False)),
    "64_tokens": ((64, 2048, 512, 256, False, True, False),
                  (7, True, True, False, False, 16, True, True, True)),
    "65_tokens": ((65, 2048, 512, 256, False, True, False),
                  (7, True, True, False, False, 16, True, True, False)),
    "i384_shared": ((32, 2048, 384, 256, True, True, False),
                    (7, True, True, False, True, 16, True, False, False)),
    "256_tokens": ((256, 2048, 512, 256, False, True, False),
                   (7, True, True, False, False, 16, False, False, False)),
    "canvas": ((256, 2816, 768, 128, False, True, False),
               (7, True, True, False, False, 16, False, False, False)),
    "prompt": ((1024, 2048, 512, 256, True, True, False),
               (7, True, True, False, True, 32, False, False, False)),
    "v3": ((32, 2048, 80, 256, True, True, False),
           (3, True, True, False, True, 16, False, False, False)),
    "pdl_off": ((32, 2048, 512, 256, True, False, False),
                (7, False, False, False, True, 16, False, False, False)),
    "w4a4": ((32, 2048, 512, 256, True, True, True),
             (7, False, False, False, True, 16, False, False, False)),
}


@pytest.fixture
def h200_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_plan` as on an H200 (sm_90, PDL), on any machine."""
    monkeypatch.setattr(launch, "overlap_active", lambda device, pdl: pdl)
    monkeypatch.setattr(launch, "overlap_pdl", lambda device, pdl: pdl)
    monkeypatch.setattr(launch, "down_gluon_applies",
                        lambda device, variant, block_m: variant == 7 and block_m == 16)


@pytest.mark.usefixtures("h200_plans")
@pytest.mark.parametrize("case", PLANS)
def test_the_plan_of_each_call(case: str) -> None:
    """The Gluon kernels with `pdl` on sm_90 for 16-slot blocks of v7 (the gate/up one for I a
    multiple of 256, without the shared expert in the routing), not where experts take many
    pairs (8 and more per expert: the Triton kernels, at 16-slot blocks too); no alignment
    where the gate/up programs route themselves (at most 512 pairs); the shared expert as items
    for at most 32 tokens; the counters with `pdl` (not with W4A4 emulation)."""
    (T, H, I, E, shared, pdl, w4a4), expected = PLANS[case]
    x = torch.empty(T, H, dtype=torch.bfloat16)
    plan = launch._plan(x, torch.zeros(T, 8, dtype=torch.int32), E, I, shared, w4a4, pdl)
    assert (*plan[:5], plan.tiles.block_m, *plan[6:]) == expected


@pytest.mark.usefixtures("h200_plans")
@pytest.mark.parametrize("case", ["256_tokens", "canvas", "prompt"])
def test_many_pairs_plan_the_ops_tiles_as_if_passed(case: str) -> None:
    """Where experts take many pairs, the op's own choice is the plan of its tiles passed
    explicitly (`--nvfp4-tiles`, e.g. block_m=16 at the canvas): the Triton kernels at the
    same blocks, no Gluon launch."""
    (T, H, I, E, shared, pdl, w4a4), _ = PLANS[case]
    x = torch.empty(T, H, dtype=torch.bfloat16)
    ids = torch.zeros(T, 8, dtype=torch.int32)
    chosen = launch._plan(x, ids, E, I, shared, w4a4, pdl)
    assert chosen == launch._plan(x, ids, E, I, shared, w4a4, pdl, tiles=chosen.tiles)


def test_self_routing_limits() -> None:
    """The gate/up programs route themselves for 1..512 pairs over at most 512 experts."""
    fits = _nvfp4_self_route.self_route_fits
    assert fits(1, 256) and fits(512, 512)
    assert not (fits(0, 256) or fits(513, 256) or fits(256, 513))
    ids = torch.zeros(32, 8, dtype=torch.int32)
    assert _nvfp4_gate_up_gluon.self_routes(ids, 256, 256)
    assert not _nvfp4_gate_up_gluon.self_routes(ids, 255, 256)  # not the routing's pairs


def test_programs_per_sm_is_what_fits(monkeypatch) -> None:
    """The grid is what is resident at once: an H200 SM has 228 KB of shared memory and 64 K
    registers."""
    h200 = SimpleNamespace(shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    fit = _nvfp4_gate_up_gluon.programs_per_sm
    cuda = torch.device("cuda")
    assert fit(cuda) == fit(cuda, 3, 3, 80) == 3  # the default: asked for, and fits
    assert fit(cuda, 3, 8, 80) == 3  # 3 x (3 x 24 KB + 2 KB) of 228 KB; 3 x 256 x 80 registers
    assert fit(cuda, 3, 8, 96) == 2  # 96 registers: 3 x 256 x 96 > 65536
    assert fit(cuda, 2, 8, 64) == 4  # 64 registers: 4 x 256 x 64; 4 x (2 x 24 KB + 2 KB)
    assert fit(cuda, 4, 8, 64) == 2  # 4 stages: 2 x (4 x 24 KB + 2 KB) of 228 KB
    assert fit(cuda, 5, 8, 64) == 1  # 5 stages: 2 x (5 x 24 KB + 2 KB) > 228 KB
    assert fit(cuda, 12, 8, 80) == 1  # never below one


def torch_gate_up(calls: list[tuple[bool, bool]]):
    """`launch_gate_up_gluon` on the CPU: its reference from the launch's own arguments
    (`_nvfp4_gluon_reference`; the counters zero before it), the calls recorded."""

    def launch(*args, **kwargs):
        calls.append((kwargs.get("topk_ids") is not None,
                      kwargs.get("shared_items") is not None))
        assert int(args[6].abs().sum()) == 0  # count
        gate_up_gluon_reference(*args, **kwargs)

    return launch


@pytest.mark.parametrize("small", [False, True])
def test_wiring_of_the_gluon_gate_up_matches_the_reference(monkeypatch, small: bool) -> None:
    """A routing the gate/up programs cannot route themselves (here: made so): the alignment,
    then no Triton expert kernel, the Gluon gate/up right after it, then the Gluon down kernel
    waiting for `I / 128` counts per 8-slot part; the output is the reference's and the
    counters are zero afterwards. Skewed routing puts 20 tokens on two of eight experts (16-slot
    blocks, some with an empty part). The launches run as their references from their own
    arguments; with `small` weights the gate's pre-activations are O(1), where SiLU is not
    linear, so a gate or up global scale passed to the wrong projection changes the output."""
    gluon_on_cpu(monkeypatch)
    monkeypatch.setattr(launch, "self_route_fits", lambda pairs, experts: False)
    gen = torch.Generator().manual_seed(7)
    experts = (random_experts(gen, 8, 128, 256, scale_2_log2=(-6.0, -5.0), max_scale_byte=0x38)
               if small else random_experts(gen, 8, 128, 256))
    x = torch.randn(20, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 20, 8, 2, skew=True)
    args = op_args(x, ids, w, experts)
    calls: list[tuple[bool, bool]] = []
    down_calls: list[int] = []
    monkeypatch.setattr(launch, "launch_gate_up_gluon", torch_gate_up(calls))
    monkeypatch.setattr(launch, "launch_down_gluon", torch_down(down_calls))
    launched: list[str] = []  # the Triton expert kernels the op launches
    real_launcher = launch.launcher
    monkeypatch.setattr(launch, "launcher", lambda kernel: (
        launched.append(kernel.fn.__name__), real_launcher(kernel))[1])
    out = nvfp4_moe(*args)
    assert calls == [(False, False)] and down_calls == [1]
    assert not launched, launched
    assert_matches_reference(out, nvfp4_moe_reference(*args))
    assert counters_zero(torch.device(DEVICE))


def spy_gate_up(monkeypatch) -> list[bool]:
    """Per `launch_gate_up_gluon` call, whether its programs route themselves (launched first,
    without an alignment)."""
    calls: list[bool] = []
    real = launch.launch_gate_up_gluon

    def spy(*args, **kwargs) -> None:
        calls.append(kwargs.get("topk_ids") is not None)
        real(*args, **kwargs)

    monkeypatch.setattr(launch, "launch_gate_up_gluon", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "two_blocks", "64_tokens",
                                  "128_tokens"])
def test_gluon_gate_up_equals_the_triton_kernels_gpu(monkeypatch, case: str) -> None:
    """The Gluon gate/up, then the Gluon down kernel: bit for bit the Triton kernels
    (`pdl=False`) at LLaDA2.1-mini shapes (32 x top-8 of 256), with every token on the same 8
    experts (one full block each, or two with 32 tokens of 64 experts), for one token, for 64
    tokens (512 pairs: the self-routing's largest tiles), launched first without an alignment
    (both kernels route themselves), and for 128 tokens (1024 pairs: after the alignment); the
    counters zero afterwards."""
    calls = spy_gate_up(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = {"llada": (256, 2048, 512, 32), "two_blocks": (64, 256, 256, 32),
                  "64_tokens": (256, 2048, 512, 64), "128_tokens": (256, 2048, 512, 128),
                  }.get(case, (64, 256, 256, 16))
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case in ("skewed", "two_blocks"))
    out = against_plain(experts, x, ids, w, {})
    assert calls == [case != "128_tokens"]  # the Gluon gate/up ran once, self-routed or not
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts)))


@pytest.mark.gpu
def test_gluon_gate_up_replays_in_a_cuda_graph_gpu(monkeypatch) -> None:
    """Captured once, replayed on new x and routing: the eager Triton path's output."""
    calls = spy_gate_up(monkeypatch)
    assert_graph_replays_like_triton(256)
    assert calls and all(calls)
