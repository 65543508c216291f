"""`DLMC_NVFP4_SHARED_ITEMS` (`custom_ops/_nvfp4_shared_items.py`): the shared expert as items
of the routed experts' two Gluon launches, which then run without an alignment as if there
were no shared expert.

On CPU: the switch as read at import, where it applies, and the op's wiring with the Gluon
launches replaced by torch computations. The kernels' forms are lowered for sm_90 in
`test_nvfp4_moe_gluon.py` and `test_nvfp4_down_gluon.py`. On the H200: the routed pair rows
equal the Triton kernels' bit for bit, the shared rows and the output up to summation order,
eager and replayed in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dlmc.custom_ops.nvfp4_moe as op_module
from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_down_self_route, _nvfp4_shared_items
from dlmc.custom_ops.moe_overlap import counters
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    bits,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
    stored,
)
from tests.custom_ops.switches import assert_reads, assert_refused
from tests.custom_ops.test_nvfp4_down_gluon import against_triton, dequantized_down
from tests.custom_ops.test_nvfp4_moe_gluon import dequantized

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

SWITCH = ("_nvfp4_shared_items", "SHARED_ITEMS", "DLMC_NVFP4_SHARED_ITEMS")


@pytest.mark.parametrize("value,expected", [(None, "True"), ("1", "True"), ("0", "False")])
def test_the_switch_is_on_by_default_and_off_with_zero(value: str | None, expected: str) -> None:
    assert_reads(*SWITCH, value, expected)


def test_a_bad_value_is_refused_naming_the_switch() -> None:
    assert_refused(*SWITCH, "items", "1, 0")


def torch_stand_ins(experts: dict[str, torch.Tensor], x: torch.Tensor,
                    calls: list[tuple]) -> tuple:
    """Stand-ins for the two Gluon launches on the CPU, which record their arguments: the
    gate/up launch (the routed pairs' h, as the self-routed kernel would, is not read here;
    the shared h rows in `SwiGLUMLP`'s bf16 maths) and the down kernel (each routed
    pair `f = t*K + k` from the routing, stored at y row `f + f // K`; the shared y rows from
    the shared h rows)."""
    gate, up, down = (dequantized(experts, "gate"), dequantized(experts, "up"),
                      dequantized_down(experts))

    def gate_up(x, sorted_pair, expert_of_block, weights, alphas, h, y, count, num_slots,
                num_pairs, shared_id, a_row_div, pdl="", gate_up_only=False, topk_ids=None,
                shared_items=None):
        calls.append(("gate_up", pdl, gate_up_only, num_pairs, a_row_div, num_slots,
                      shared_items is not None))
        if shared_items is not None:
            shared_gate, shared_up, h_row0, slot = shared_items
            assert slot < num_slots
            g = (x.float() @ shared_gate.float().T).bfloat16().float()
            u = (x.float() @ shared_up.float().T).bfloat16().float()
            h[h_row0:h_row0 + x.shape[0]] = ((g * torch.sigmoid(g)).bfloat16().float()
                                             * u).bfloat16()

    def down_launch(h, sorted_pair, expert_of_block, words, codes, alpha, y, num_pairs,
                    shared_id, count=None, num_slots=0, writers=0, pdl=False, per_part=False,
                    topk_ids=None, pair_gap=0, shared_items=None):
        calls.append(("down", num_pairs, pair_gap, topk_ids is not None, per_part,
                      shared_items is not None))
        if shared_items is not None:
            shared_down, h_row0, slot, tokens = shared_items
            assert slot < num_slots and tokens == x.shape[0]
            rows = h[h_row0:h_row0 + tokens].float() @ shared_down.float().T
            y.view(tokens, pair_gap + 1, -1)[:, pair_gap] = rows.bfloat16()
        for f, expert in enumerate(topk_ids.reshape(-1).tolist()):
            row = x[f // pair_gap].float()
            g, u = gate[expert] @ row, up[expert] @ row
            hidden = (g * torch.sigmoid(g) * u).bfloat16()
            y[f + f // pair_gap] = (down[expert] @ hidden.float()).bfloat16()

    return gate_up, down_launch


def test_wiring_of_the_shared_items_matches_the_reference(monkeypatch) -> None:
    """Where the routed experts alone take the no-alignment path: no alignment and no Triton
    expert kernel; the Gluon gate/up first ("first", the routed pairs `T*K` with x row
    `pair // K`, the shared items with their h rows after the routed blocks' and the counter
    slot after theirs), then the Gluon down kernel (self-routed, `pair_gap` K, the shared
    items on that slot, for the T tokens); the output is the reference's (skewed routing: 20
    tokens on two of four experts, I = 256)."""
    gen = torch.Generator().manual_seed(7)
    T, H, I, K = 20, 128, 256, 2
    experts = random_experts(gen, 4, H, I)
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, 4, K, skew=True)
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, nvfp4_moe_reference(*args), H, I)
    calls: list[tuple] = []
    gate_up, down_launch = torch_stand_ins(experts, x, calls)
    monkeypatch.setattr(_nvfp4_shared_items, "SHARED_ITEMS", True)
    monkeypatch.setattr(op_module, "edge_pdl", lambda device: True)
    monkeypatch.setattr(op_module, "_alone_without_alignment", lambda *a: True)
    monkeypatch.setattr(op_module, "down_gluon_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "gate_up_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "launch_moe_gluon", gate_up)
    monkeypatch.setattr(op_module, "launch_down_gluon", down_launch)
    real_combine = op_module.combine_pairs  # (no PDL under the interpreter)
    monkeypatch.setattr(op_module, "combine_pairs",
                        lambda y, w, out, s, pdl: real_combine(y, w, out, s, False))
    monkeypatch.setattr(op_module, "route_pairs", lambda *a, **k: pytest.fail("aligned"))
    monkeypatch.setattr(op_module, "launcher", lambda kernel: pytest.fail(kernel.fn.__name__))
    with contextlib.nullcontext():  # (v7)
        out = nvfp4_moe(*args, **shared)
    blocks = op_module.alignment_buffers(ids, 4, op_module.route_block_m(T, K, 4))[1].numel()
    slots = blocks + -(-T // op_module.route_block_m(T, K, 4))
    assert calls == [("gate_up", "first", True, T * K, K, slots, True),
                     ("down", T * K, K, True, True, True)]
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))


def test_items_need_the_routed_experts_path_without_alignment(monkeypatch) -> None:
    """The items apply where the routed experts alone would run without an alignment: the
    Gluon gate/up and down kernels (stood in here), the down kernel's tickets and own routing,
    I >= 256 (two K-steps per down ring slot) and at most 512 routed pairs (`nvfp4_moe`); and
    at most 32 tokens, H a multiple of 128, I of 32, the switch on (`shared_items_apply`);
    else the shared expert stays in the routing."""
    alone = op_module._alone_without_alignment
    applies: list[tuple] = []
    monkeypatch.setattr(op_module, "down_gluon_applies", lambda *a: a[-1] == 16)
    monkeypatch.setattr(op_module, "gate_up_applies",
                        lambda *a: applies.append(a[-4:]) or a[-2])
    monkeypatch.setattr(op_module, "overlap_active", lambda device: True)
    monkeypatch.setattr(op_module, "overlap_pdl", lambda device: True)
    x = torch.empty(32, 2048, dtype=torch.bfloat16)
    ids = torch.zeros(32, 8, dtype=torch.int32)
    with contextlib.nullcontext():  # (v7)
        assert alone(x, ids, 256, 512)
        assert applies == [(True, 256, True, False)]  # (PDL, E, the Gluon down, no shared)
        assert not alone(x, ids, 256, 128)  # I < 256
        assert not alone(x, torch.zeros(65, 8, dtype=torch.int32), 256, 512)  # 520 pairs
        monkeypatch.setattr(op_module, "down_tickets", lambda: False)
        assert not alone(x, ids, 256, 512)
        monkeypatch.setattr(op_module, "down_tickets", lambda: True)
        monkeypatch.setattr(_nvfp4_down_self_route, "DOWN_SELF_ROUTE", False)
        assert not alone(x, ids, 256, 512)
    fits = _nvfp4_shared_items.shared_items_apply
    assert fits(1, 2048, 512) and fits(32, 2048, 512) and fits(32, 128, 32)
    assert not (fits(33, 2048, 512) or fits(0, 2048, 512) or fits(32, 2112, 512)
                or fits(32, 2048, 496))
    monkeypatch.setattr(_nvfp4_shared_items, "SHARED_ITEMS", False)
    assert not fits(32, 2048, 512)


def spy_items(monkeypatch) -> list[bool]:
    """Per Gluon gate/up launch, whether it was handed shared items (no alignment with them:
    only the Triton kernels that the output is compared with align)."""
    monkeypatch.setattr(_nvfp4_shared_items, "SHARED_ITEMS", True)
    calls: list[bool] = []
    real, real_route = op_module.launch_moe_gluon, op_module.route_pairs

    def launch(*a, **k) -> None:
        calls.append(k.get("shared_items") is not None)
        real(*a, **k)

    def route(*a, **k) -> object:
        assert _nvfp4_down_gluon.MODE == "triton" or not any(calls), "items: no alignment"
        return real_route(*a, **k)

    monkeypatch.setattr(op_module, "launch_moe_gluon", launch)
    monkeypatch.setattr(op_module, "route_pairs", route)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "64_tokens"])
def test_shared_items_equal_the_triton_kernels_gpu(monkeypatch, case: str) -> None:
    """The Triton kernels' output with the shared expert: the routed pair rows bit for bit,
    the shared rows and the output up to summation order, at LLaDA2.1-mini shapes (32 x top-8
    of 256, I = 512), with every token on the same 8 experts, and for one token; 64 tokens
    (more than the items take) keep the shared expert in the routing, bit for bit. The
    counters are zero afterwards."""
    calls = spy_items(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = {"llada": (256, 2048, 512, 32),
                  "64_tokens": (256, 2048, 512, 64)}.get(case, (8, 256, 256, 16))
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case == "skewed")
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, nvfp4_moe_reference(*args), H, I)
    items = T <= 32
    out = against_triton(monkeypatch, "gluon", experts, x, ids, w, shared, bitwise=not items)
    assert calls == ([True] if items else [])  # (64 tokens: the Triton gate/up)
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))
    if items:  # the pair rows: routed ones bit for bit
        rows = against_triton(monkeypatch, "gluon", experts, x, ids, w, shared | {"pairs": True},
                              bitwise=False).view(T, 9, H)
        with contextlib.nullcontext():  # (v7)
            expected = nvfp4_moe(*op_args(x, ids, w, stored(experts)), **shared,
                                 pairs=True).view(T, 9, H)  # (MODE triton again)
        assert torch.equal(bits(rows[:, :8]), bits(expected[:, :8]))
        assert_matches_reference(rows[:, 8], expected[:, 8])


@pytest.mark.gpu
def test_shared_items_replay_in_a_cuda_graph_gpu(monkeypatch) -> None:
    """Captured once and replayed on new x and routing: the eager output bit for bit, and the
    counters zero."""
    calls = spy_items(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    experts = stored({k: v.to(DEVICE) for k, v in random_experts(gen, 64, 256, 256).items()})
    args_of = [op_args(torch.randn(32, 256, generator=gen).bfloat16().to(DEVICE),
                       *random_routing(gen, 32, 64, 8, False), experts) for _ in range(2)]
    shared = shared_expert(gen, args_of[0][0], args_of[0][0], 256, 256)
    static = [a.clone() for a in args_of[0]]
    with contextlib.nullcontext():  # (v7)
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "gluon")
        nvfp4_moe(*static, **shared)  # warm (compiles the kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = nvfp4_moe(*static, **shared)
        for source in (args_of[1], args_of[0]):
            for dst, src in zip(static[:3], source[:3], strict=True):
                dst.copy_(src)
            graph.replay()
            assert torch.equal(bits(out), bits(nvfp4_moe(*source, **shared)))
            assert int(counters(out.device, 1).abs().sum()) == 0
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "triton")
    assert calls and all(calls)
