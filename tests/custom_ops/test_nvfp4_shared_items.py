"""The shared expert as items of the routed experts' two Gluon launches
(`custom_ops/_nvfp4_shared_items.py`), which then run without an alignment as if there were no
shared expert: with `pdl=True` on sm_90, at most 32 tokens.

On CPU: where they apply (`_nvfp4_moe_launch._plan`: test_nvfp4_gate_up_gluon.py, and
`shared_items_apply` here) and the op's wiring with the Gluon launches replaced by torch
computations. The kernels' forms are lowered for sm_90 in test_kernels_compile_sm90.py. On the
H200: the routed pair rows equal the Triton kernels' (`pdl=False`) bit for bit, the shared rows
and the output up to summation order, eager and replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops import _nvfp4_shared_items
from dlmc.custom_ops.moe_align import alignment_buffers, route_block_m
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    against_plain,
    assert_matches_reference,
    bits,
    counters_zero,
    dequantized,
    gluon_on_cpu,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
    stored,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def torch_stand_ins(experts: dict[str, torch.Tensor], x: torch.Tensor,
                    calls: list[tuple]) -> tuple:
    """Stand-ins for the two Gluon launches on the CPU, which record their arguments: the
    gate/up launch (the routed pairs' h, as the self-routed kernel would, is not read here;
    the shared h rows in `SwiGLUMLP`'s bf16 maths) and the down kernel (each routed
    pair `f = t*K + k` from the routing, stored at y row `f + f // K`; the shared y rows from
    the shared h rows)."""
    gate, up, down = (dequantized(experts, name) for name in ("gate", "up", "down"))

    def gate_up(x, sorted_pair, expert_of_block, weights, alphas, h, count, num_pairs,
                shared_id, a_row_div, topk_ids=None, shared_items=None):
        calls.append(("gate_up", topk_ids is not None, num_pairs, a_row_div,
                      shared_items is not None))
        if shared_items is not None:
            shared_gate, shared_up, h_row0, slot = shared_items
            assert slot == expert_of_block.numel()  # the slot after the routed blocks'
            g = (x.float() @ shared_gate.float().T).bfloat16().float()
            u = (x.float() @ shared_up.float().T).bfloat16().float()
            h[h_row0:h_row0 + x.shape[0]] = ((g * torch.sigmoid(g)).bfloat16().float()
                                             * u).bfloat16()

    def down_launch(h, sorted_pair, expert_of_block, words, codes, alpha, y, num_pairs,
                    shared_id, count, num_slots, writers, per_part=False, topk_ids=None,
                    pair_gap=0, shared_items=None):
        calls.append(("down", num_pairs, num_slots, pair_gap, topk_ids is not None, per_part,
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
    expert kernel; the Gluon gate/up first, self-routed (the routed pairs `T*K` with x row
    `pair // K`, the shared items with their h rows after the routed blocks' and the counter
    slot after theirs), then the Gluon down kernel (self-routed, `pair_gap` K, the shared
    items on that slot, for the T tokens); the output is the reference's (skewed routing: 20
    tokens on two of eight experts, I = 256)."""
    gluon_on_cpu(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    T, H, I, K = 20, 128, 256, 2
    experts = random_experts(gen, 8, H, I)
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, 8, K, skew=True)
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, nvfp4_moe_reference(*args), H, I)
    calls: list[tuple] = []
    gate_up, down_launch = torch_stand_ins(experts, x, calls)
    monkeypatch.setattr(launch, "launch_gate_up_gluon", gate_up)
    monkeypatch.setattr(launch, "launch_down_gluon", down_launch)
    monkeypatch.setattr(launch, "align_pairs_to_blocks",
                        lambda *a, **k: pytest.fail("aligned"))
    monkeypatch.setattr(launch, "launcher", lambda kernel: pytest.fail(kernel.fn.__name__))
    out = nvfp4_moe(*args, **shared)
    blocks = alignment_buffers(ids, 8, route_block_m(T, K, 8))[1].numel()
    slots = blocks + -(-T // route_block_m(T, K, 8))
    assert calls == [("gate_up", True, T * K, K, True),
                     ("down", T * K, slots, K, True, True, True)]
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))


def test_items_take_at_most_32_tokens() -> None:
    """At most 32 tokens (one gate/up item covers them all), H a multiple of 128, I of 32 (the
    rest: `_nvfp4_moe_launch._plan`, test_nvfp4_gate_up_gluon.py)."""
    fits = _nvfp4_shared_items.shared_items_apply
    assert fits(1, 2048, 512) and fits(32, 2048, 512) and fits(32, 128, 32)
    assert not (fits(33, 2048, 512) or fits(0, 2048, 512) or fits(32, 2112, 512)
                or fits(32, 2048, 496))


def spy_items(monkeypatch) -> list[bool]:
    """Per Gluon gate/up launch, whether it was handed shared items (no alignment with them:
    only the Triton kernels that the output is compared with align)."""
    calls: list[bool] = []
    real, real_align = launch.launch_gate_up_gluon, launch.align_pairs_to_blocks

    def spy(*a, **k) -> None:
        calls.append(k.get("shared_items") is not None)
        real(*a, **k)

    def align(topk_ids, num_experts, block_m, shared_expert=False, pdl=False) -> object:
        assert not (pdl and any(calls)), "items: no alignment"
        return real_align(topk_ids, num_experts, block_m, shared_expert, pdl)

    monkeypatch.setattr(launch, "launch_gate_up_gluon", spy)
    monkeypatch.setattr(launch, "align_pairs_to_blocks", align)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "64_tokens"])
def test_shared_items_equal_the_triton_kernels_gpu(monkeypatch, case: str) -> None:
    """The Triton kernels' output (`pdl=False`) with the shared expert: the routed pair rows
    bit for bit, the shared rows and the output up to summation order, at LLaDA2.1-mini shapes
    (32 x top-8 of 256, I = 512), with every token on the same 8 experts, and for one token; 64
    tokens (more than the items take) keep the shared expert in the routing, bit for bit. The
    counters are zero afterwards."""
    calls = spy_items(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = {"llada": (256, 2048, 512, 32),
                  "64_tokens": (256, 2048, 512, 64)}.get(case, (64, 256, 256, 16))
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case == "skewed")
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, nvfp4_moe_reference(*args), H, I)
    items = T <= 32
    out = against_plain(experts, x, ids, w, shared, bitwise=not items)
    assert calls == ([True] if items else [])  # (64 tokens: the Triton gate/up)
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))
    if items:  # the pair rows: routed ones bit for bit
        rows = against_plain(experts, x, ids, w, shared | {"pairs": True},
                             bitwise=False).view(T, 9, H)
        expected = nvfp4_moe(*op_args(x, ids, w, stored(experts)), **shared, pairs=True,
                             pdl=False).view(T, 9, H)
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
    nvfp4_moe(*static, **shared)  # warm (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_moe(*static, **shared)
    for source in (args_of[1], args_of[0]):
        for dst, src in zip(static[:3], source[:3], strict=True):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(bits(out), bits(nvfp4_moe(*source, **shared)))
        assert counters_zero(out.device)
    assert calls and all(calls)
