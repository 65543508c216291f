"""`DLMC_NVFP4_GATE_UP=gluon` (the default where it applies): `nvfp4_moe`'s routed gate/up as the
Gluon gate/up items (`_nvfp4_gate_up_gluon`) in a launch of their own
(`launch_moe_gluon(gate_up_only=True)`), then the Gluon down kernel.

On CPU: the switch's conditions and the op's wiring with both Gluon launches replaced by torch
computations (the down stand-in checks the per-part counts). On the H200 the op's output
equals the Triton kernels' bit for bit, eager and replayed in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dlmc.custom_ops.nvfp4_moe as op_module
from dlmc.custom_ops import (
    _nvfp4_down_gluon,
    _nvfp4_down_self_route,
    _nvfp4_moe_gluon,
    _nvfp4_self_route,
)
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    op_args,
    random_experts,
    random_routing,
)
from tests.custom_ops.test_nvfp4_down_gluon import (
    against_triton,
    assert_graph_replays_like_triton,
    dequantized_down,
    torch_down,
)
from tests.custom_ops.test_nvfp4_moe_gluon import dequantized

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def test_the_gate_up_switch_applies_only_with_its_conditions(monkeypatch) -> None:
    """`DLMC_NVFP4_GATE_UP=gluon` (the default): with the Gluon down kernel, without a shared
    expert, where the fused kernel runs."""
    monkeypatch.setattr(_nvfp4_down_gluon, "GATE_UP", "gluon")
    applies = _nvfp4_moe_gluon.gate_up_applies
    args = (7, 2048, 512, False, True, True, 256)
    assert not applies(torch.device("cpu"), *args, True, False)  # no GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert applies(cuda, *args, True, False)
    assert not applies(cuda, *args, False, False)  # the Triton down kernel
    assert not applies(cuda, *args, True, True)  # a shared expert: the Triton gate/up
    assert not applies(cuda, 7, 2048, 384, False, True, True, 256, True, False)  # I % 256
    assert not applies(cuda, 7, 2048, 512, False, True, False, 256, True, False)  # no PDL
    monkeypatch.setattr(_nvfp4_down_gluon, "GATE_UP", "triton")
    assert not applies(cuda, *args, True, False)  # switched off


def torch_gate_up(experts: dict[str, torch.Tensor], calls: list[tuple[str, bool, bool]]):
    """A stand-in for `launch_moe_gluon(gate_up_only=True)` on the CPU: every routed pair's h
    row (even-odd columns, bf16), then one count per item on its block's counter (`I / 128`
    per 8-slot part that holds a pair), as the kernel's gate/up items signal."""
    gate, up = (dequantized(experts, name) for name in ("gate", "up"))

    def launch(x, sorted_pair, expert_of_block, weights, alphas, h, y, count, num_slots,
               num_pairs, shared_id, a_row_div, pdl="", gate_up_only=False, topk_ids=None):
        calls.append((pdl, gate_up_only, topk_ids is not None))
        assert count.numel() >= 2 * num_slots + 1 and int(count.abs().sum()) == 0
        block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
        for block, expert in enumerate(expert_of_block.tolist()):
            if expert < 0 or expert == shared_id:
                continue
            for first in range(block * block_m, block * block_m + block_m, 8):
                if int(sorted_pair[first]) >= num_pairs:
                    continue  # a part without pairs: no items
                for slot in range(first, first + 8):
                    pair = int(sorted_pair[slot])
                    if pair < num_pairs:
                        row = x[pair // a_row_div].float()
                        g, u = gate[expert] @ row, up[expert] @ row
                        natural = (g * torch.sigmoid(g) * u).bfloat16()
                        h[slot] = natural.view(-1, 64, 2).transpose(1, 2).reshape(-1)
                count[block] += h.shape[1] // 128

    return launch


def test_wiring_of_the_gluon_gate_up_matches_the_reference(monkeypatch) -> None:
    """`DLMC_NVFP4_GATE_UP=gluon`: no Triton expert kernel, the fused kernel's gate/up items
    alone right after the routing ("enter"), then the Gluon down kernel waiting for `I / 128`
    counts per 8-slot part; the output is the reference's and the counters are zero
    afterwards. Skewed routing puts 20 tokens on two experts (16-slot blocks, some with an
    empty part)."""
    gen = torch.Generator().manual_seed(7)
    experts = random_experts(gen, 4, 128, 256)
    x = torch.randn(20, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 20, 4, 2, skew=True)
    args = op_args(x, ids, w, experts)
    calls: list[tuple[str, bool, bool]] = []
    down_calls: list[int] = []
    counters = op_module.counters(torch.device(DEVICE), 1)
    monkeypatch.setattr(op_module, "down_gluon_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "gate_up_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "launch_moe_gluon", torch_gate_up(experts, calls))
    monkeypatch.setattr(op_module, "launch_down_gluon",
                        torch_down(dequantized_down(experts), down_calls))
    launched: list[str] = []  # the Triton expert kernels the op launches
    real_launcher = op_module.launcher
    monkeypatch.setattr(op_module, "launcher", lambda kernel: (
        launched.append(kernel.fn.__name__), real_launcher(kernel))[1])
    with contextlib.nullcontext():  # (v7)
        out = nvfp4_moe(*args)
    # (no routing handed over: the interpreter's launches have no PDL to route during)
    assert calls == [("enter", True, False)] and down_calls == [1]
    assert "_gate_up_kernel" not in launched and "_down_kernel" not in launched, launched
    assert_matches_reference(out, nvfp4_moe_reference(*args))
    assert int(counters.abs().sum()) == 0


def test_self_routing_limits() -> None:
    """The gate/up programs route themselves for 1..512 pairs over at most 512 experts."""
    fits = _nvfp4_self_route.self_route_fits
    assert fits(1, 256) and fits(512, 512)
    assert not (fits(0, 256) or fits(513, 256) or fits(256, 513))


def spy_gate_up_only(monkeypatch, self_route: bool = False, no_align: bool = False
                     ) -> list[tuple[bool, bool]]:
    """`DLMC_NVFP4_GATE_UP=gluon`, `DLMC_NVFP4_SELF_ROUTE` as `self_route` and
    `DLMC_NVFP4_DOWN_SELF_ROUTE` as `no_align`, and per `launch_moe_gluon` call
    (`gate_up_only`, whether it was handed `topk_ids`), checking that it launched first and
    the down kernel routed itself, with no alignment launch, exactly with `no_align`."""
    monkeypatch.setattr(_nvfp4_down_gluon, "GATE_UP", "gluon")
    monkeypatch.setattr(_nvfp4_self_route, "SELF_ROUTE", self_route)
    monkeypatch.setattr(_nvfp4_down_self_route, "DOWN_SELF_ROUTE", no_align)
    calls: list[tuple[bool, bool]] = []
    real, real_down = op_module.launch_moe_gluon, op_module.launch_down_gluon
    real_route = op_module.route_pairs

    def launch(*a, **k) -> None:
        assert (k.get("pdl") == "first") == no_align, k.get("pdl")
        calls.append((k.get("gate_up_only", False), k.get("topk_ids") is not None))
        real(*a, **k)

    def down(*a, **k) -> None:
        assert (k.get("topk_ids") is not None) == no_align
        real_down(*a, **k)

    def route(*a, **k) -> object:  # (the Triton kernels that the output is compared with align)
        assert not (no_align and _nvfp4_down_gluon.MODE == "gluon"), "no_align: no alignment"
        return real_route(*a, **k)

    monkeypatch.setattr(op_module, "launch_moe_gluon", launch)
    monkeypatch.setattr(op_module, "launch_down_gluon", down)
    monkeypatch.setattr(op_module, "route_pairs", route)
    return calls


# (self_route, no_align): aligned first; self-routed beside the alignment; self-routed first
# and the down kernel self-routed, no alignment (`DLMC_NVFP4_DOWN_SELF_ROUTE`)
ROUTINGS = pytest.mark.parametrize("self_route,no_align",
                                   [(False, False), (True, False), (True, True)],
                                   ids=["aligned", "self_routed", "no_align"])


@pytest.mark.gpu
@ROUTINGS
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "two_blocks", "64_tokens"])
def test_gluon_gate_up_equals_the_triton_kernels_gpu(monkeypatch, case: str, self_route: bool,
                                                      no_align: bool) -> None:
    """`DLMC_NVFP4_GATE_UP=gluon` then the Gluon down kernel (tickets): bit for bit the Triton
    kernels at LLaDA2.1-mini shapes (32 x top-8 of 256), with every token on the same 8
    experts (one full block each, or two with 32 tokens of 64 experts), for one token, and
    for 64 tokens (512 pairs: the self-routing's largest tiles); the counters zero
    afterwards. `self_route`: the gate/up programs route their own items
    (`_nvfp4_self_route`), which takes the llada shape in several items per program;
    `no_align`: they launch first and the down kernel routes its items too."""
    calls = spy_gate_up_only(monkeypatch, self_route, no_align)
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = {"llada": (256, 2048, 512, 32), "two_blocks": (64, 256, 256, 32),
                  "64_tokens": (256, 2048, 512, 64)}.get(case, (8, 256, 256, 16))
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case in ("skewed", "two_blocks"))
    out = against_triton(monkeypatch, "gluon", experts, x, ids, w, {})
    assert calls == [(True, True)]  # the Gluon gate/up ran, alone, handed the routing
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts)))


@pytest.mark.gpu
@ROUTINGS
def test_gluon_gate_up_replays_in_a_cuda_graph_gpu(monkeypatch, self_route: bool,
                                                   no_align: bool) -> None:
    """Captured once, replayed on new x and routing: the eager Triton path's output."""
    calls = spy_gate_up_only(monkeypatch, self_route, no_align)
    assert_graph_replays_like_triton(monkeypatch, "gluon", 256)
    assert calls and all(gate_up_only for gate_up_only, _ in calls)
