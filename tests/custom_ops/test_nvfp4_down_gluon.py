"""`nvfp4_moe`'s routed down projection in the Gluon kernel (`_nvfp4_down_gluon`), where it
applies with `pdl=True`.

On CPU the Gluon kernel cannot run: there its conditions and launch checks are tested, and the
op's wiring (gate/up storing h even columns first per 128, the shared expert's down parts alone
in the Triton kernel) with the Gluon launch replaced by a torch computation that reads h the way
the kernel does. Its sm_90 lowering is checked in test_kernels_compile_sm90.py. On the H200 the
op's output equals the Triton kernels' (`pdl=False`) bit for bit, eager and replayed in a CUDA
graph.
"""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_gluon_parts
from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops._nvfp4_gluon_reference import down_gluon_reference
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    against_plain,
    assert_matches_reference,
    bits,
    counters_zero,
    gluon_on_cpu,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
    stored,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def test_applies_only_on_hopper_to_v7_and_16_slot_blocks(monkeypatch) -> None:
    applies = _nvfp4_down_gluon.down_gluon_applies
    assert not applies(torch.device("cpu"), 7, 16)  # no GPU
    monkeypatch.setattr(_nvfp4_down_gluon, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert applies(cuda, 7, 16)
    assert not applies(cuda, 7, 32)  # prompt chunks: Triton
    assert not applies(cuda, 3, 16)  # v3's forms
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not applies(cuda, 7, 16)  # Blackwell: not tuned there


def test_item_tags_must_fit_in_int32() -> None:
    """Ring slots tag items as `item * 1024 + expert`: the largest item and expert id that fit
    pass, one more of either is refused, naming the kernel."""
    check = _nvfp4_gluon_parts.check_item_tags
    check(2**21 - 1, 1024, "k")
    for items, experts in ((2**21, 8), (1, 1025)):
        with pytest.raises(ValueError, match=rf"k tags items .*{items} items .*{experts} experts"):
            check(items, experts, "k")


def launch_args(inter: int) -> tuple:
    """`launch_down_gluon`'s arguments up to `shared_id`: 2 blocks of 16 slots, 8 pairs, 4
    experts, H 256."""
    return (torch.zeros(32, inter, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), torch.zeros(4, 256, inter // 2, dtype=torch.uint8),
            torch.zeros(4, 256, inter // 16, dtype=torch.uint8), torch.ones(4),
            torch.zeros(8, 256, dtype=torch.bfloat16), 8, 4)


def test_tickets_need_a_counter_past_the_slots() -> None:
    """The ticket counter after the slots' must exist: a buffer of exactly `2 * num_slots` is
    refused, naming what to allocate."""
    with pytest.raises(ValueError, match=r"needs 5 counters .*num_slots \+ 1\)`\), got 4"):
        _nvfp4_down_gluon.launch_down_gluon(*launch_args(256), torch.zeros(4, dtype=torch.int32),
                                            2, 2)


@pytest.mark.parametrize("ids,inter", [(7, 256), (8, 128)], ids=["wrong_ids", "one_k_step"])
def test_self_routing_needs_all_ids_and_two_k_steps(ids: int, inter: int) -> None:
    """`topk_ids` (the down kernel routing its own items, `_nvfp4_down_self_route`) is refused,
    naming what it needs, with ids that are not the routing's `num_pairs`, or with one K-step
    (the consumers read gate/up's pairs after the second)."""
    with pytest.raises(ValueError, match=rf"self-routing needs 8 ids and I >= 256 .*{ids} ids, "
                                         rf"I={inter}"):
        _nvfp4_down_gluon.launch_down_gluon(*launch_args(inter), torch.zeros(5, dtype=torch.int32),
                                            2, 2, topk_ids=torch.zeros(ids, dtype=torch.int32))


def torch_down(calls: list[int]):
    """`launch_down_gluon` on the CPU, without self-routing: after the per-block counts it waits
    for, its reference from the launch's own arguments (`_nvfp4_gluon_reference`: h read as
    the kernel reads it, even-odd columns, blocks of the shared expert skipped, y in bf16)."""

    def launch(h, sorted_pair, expert_of_block, words, codes, alpha, y, num_pairs, shared_id,
               count, num_slots, writers, per_part=False, topk_ids=None):
        assert topk_ids is None
        calls.append(1)
        block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
        for block, expert in enumerate(expert_of_block.tolist()):
            if expert < 0 or expert == shared_id:
                continue
            # the per-block wait: gate/up signalled each of its programs (`per_part`: each of
            # its items, `writers` per 8-slot part that holds a pair)
            live = sum(int(sorted_pair[block * block_m + part]) < num_pairs
                       for part in range(0, block_m, 8))
            expected = writers * (live if per_part else 1)
            assert int(count[block]) == expected and int(count[num_slots + block]) == 0
        down_gluon_reference(h, sorted_pair, expert_of_block, words, codes, alpha, y,
                             num_pairs, shared_id, count, num_slots, writers, per_part)

    return launch


@pytest.mark.parametrize("with_shared", [False, True])
def test_wiring_with_a_torch_down_matches_the_reference(monkeypatch, with_shared: bool) -> None:
    """The Triton gate/up kernel (I = 128: no Gluon gate/up) stores even-odd h rows (reordered
    in registers in its 128-column N-tiles), read back by the stand-in, the shared expert's
    down parts run in the Triton kernel (`PARTS_ONLY`), and the output is the reference's;
    skewed routing puts 20 tokens on two of eight experts (two 16-slot blocks each). Every
    routed block was signalled by all its gate/up programs, and the counters are zero
    afterwards."""
    gluon_on_cpu(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    experts = random_experts(gen, 8, 128, 128)
    x = torch.randn(20, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 20, 8, 2, skew=True)
    args = op_args(x, ids, w, experts)
    shared = shared_expert(gen, x, nvfp4_moe_reference(*args), 128, 128) if with_shared else {}
    calls: list[int] = []
    monkeypatch.setattr(launch, "launch_down_gluon", torch_down(calls))
    launched: list[str] = []  # the Triton kernels the op launches
    real_launcher = launch.launcher
    monkeypatch.setattr(launch, "launcher", lambda kernel: (
        launched.append(kernel.fn.__name__), real_launcher(kernel))[1])
    out = nvfp4_moe(*args, **shared)
    assert calls == [1]
    assert ("_down_kernel" in launched) == with_shared, launched  # the shared parts alone
    assert "_gate_up_kernel" in launched
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))
    assert counters_zero(torch.device(DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "shared", "i384"])
def test_gluon_down_equals_triton_down_gpu(case: str) -> None:
    """Bit for bit the Triton kernels: LLaDA2.1-mini shapes with uniform routing (32 x top-8
    of 256), every token on the same 8 experts (16-slot blocks full: both 8-slot parts), one
    token, with 40 tokens and the shared expert's parts (in the routing), and I = 384 (the
    Triton gate/up before the Gluon down kernel); the counters zero again afterwards."""
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = {"llada": (256, 2048, 512, 32), "shared": (256, 2048, 512, 40),
                  "i384": (256, 2048, 384, 32)}.get(case, (64, 256, 128, 16))
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case == "skewed")
    shared = {}
    if case == "shared":
        shared = shared_expert(gen, x, nvfp4_moe_reference(*op_args(x, ids, w, experts)), H, I)
    out = against_plain(experts, x, ids, w, shared)
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts), **shared))


def assert_graph_replays_like_triton(inter: int, with_shared: bool = False) -> None:
    """`nvfp4_moe` (and a shared expert), captured once and replayed on new x and routing,
    gives the eager Triton path's (`pdl=False`) output bit for bit, and leaves `moe_overlap`'s
    counters zero."""
    gen = torch.Generator().manual_seed(5)
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, 64, 256, inter).items()}
    args_of = []
    for _ in range(2):
        x = torch.randn(32, 256, generator=gen).bfloat16().to(DEVICE)
        ids, w = random_routing(gen, 32, 64, 8, skew=False)
        args_of.append(op_args(x, ids, w, stored(experts)))
    shared = {}
    if with_shared:
        shared = shared_expert(gen, args_of[0][0], nvfp4_moe_reference(*args_of[0]), 256, inter)
    static = [a.clone() for a in args_of[0]]
    nvfp4_moe(*static, **shared)  # warm (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_moe(*static, **shared)
    for source in (args_of[1], args_of[0]):
        for dst, src in zip(static[:3], source[:3], strict=True):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(bits(out), bits(nvfp4_moe(*source, **shared, pdl=False)))
        assert counters_zero(out.device)


@pytest.mark.gpu
def test_gluon_down_replays_in_a_cuda_graph_gpu() -> None:
    """Captured once, replayed on new x and routing: the eager Triton path's output (I = 128:
    the Triton gate/up, the Gluon down kernel)."""
    assert_graph_replays_like_triton(128)
