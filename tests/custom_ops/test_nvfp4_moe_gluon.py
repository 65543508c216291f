"""`DLMC_NVFP4_DOWN=fused`: `nvfp4_moe`'s routed experts (gate/up and down) in one Gluon kernel
(`_nvfp4_moe_gluon`).

On CPU: the switch's conditions, how many programs fit on an SM, the kernel's sm_90 lowering
(in a subprocess without `TRITON_INTERPRET`), and the op's wiring with the Gluon launch
replaced by a torch computation (the shared expert's parts alone in the Triton kernels). On the
H200 the op's output equals the Triton kernels' bit for bit, eager and replayed in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import dlmc.custom_ops.nvfp4_moe as op_module
from dlmc.custom_ops import (
    _nvfp4_down_gluon,
    _nvfp4_gate_up_gluon,
    _nvfp4_gluon_parts,
    _nvfp4_moe_gluon,
    _nvfp4_shared_items,
)
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
)
from tests.custom_ops.test_nvfp4_down_gluon import (
    against_triton,
    assert_graph_replays_like_triton,
    compile_gluon_sm90,
    dequantized_down,
    run_lowering_check,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def test_the_switch_applies_only_with_its_conditions(monkeypatch) -> None:
    monkeypatch.setenv("DLMC_NVFP4_DOWN", "fused")
    assert _nvfp4_down_gluon._switch("DLMC_NVFP4_DOWN") == "fused"
    monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "fused")
    applies = _nvfp4_moe_gluon.fused_applies
    assert not applies(torch.device("cpu"), 7, 2048, 512, False, True, True)  # no GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert applies(cuda, 7, 2048, 512, False, True, True)
    assert not applies(cuda, 5, 2048, 512, False, True, True)  # v5's stored forms
    assert not applies(cuda, 7, 2048, 384, False, True, True)  # I not a multiple of 256
    assert not applies(cuda, 7, 2048, 512, True, True, True)  # W4A4 emulation
    assert not applies(cuda, 7, 2048, 512, False, False, True)  # op traced by Inductor
    assert not applies(cuda, 7, 2048, 512, False, True, False)  # no PDL launches
    assert not applies(cuda, 7, 2048, 512, False, True, True, 1024)  # item tags: < 1024 experts
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not applies(cuda, 7, 2048, 512, False, True, True)  # Blackwell: not tuned there
    monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "gluon")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not applies(cuda, 7, 2048, 512, False, True, True)  # the down-only kernel instead


def test_programs_per_sm_is_what_fits(monkeypatch) -> None:
    """The grid must be resident at once (down items wait for other programs' gate/up items):
    an H200 SM has 228 KB of shared memory and 64 K registers."""
    h200 = SimpleNamespace(shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    fit = _nvfp4_moe_gluon.programs_per_sm
    cuda = torch.device("cuda")
    assert fit(cuda, 3, 3, 80) == 3  # the default: asked for, and fits
    assert fit(cuda, 3, 8, 80) == 3  # 3 x (3 x 24 KB + 2 KB) of 228 KB; 3 x 256 x 80 registers
    assert fit(cuda, 3, 8, 96) == 2  # 96 registers: 3 x 256 x 96 > 65536 (session 25's hang)
    assert fit(cuda, 2, 8, 64) == 4  # 64 registers: 4 x 256 x 64; 4 x (2 x 24 KB + 2 KB)
    assert fit(cuda, 4, 8, 64) == 2  # 4 stages: 2 x (4 x 24 KB + 2 KB) of 228 KB
    assert fit(cuda, 5, 8, 64) == 1  # 5 stages: 2 x (5 x 24 KB + 2 KB) > 228 KB
    assert fit(cuda, 12, 8, 80) == 1  # never below one


def fused_types() -> dict[str, str]:
    """The fused kernel's non-i32 argument types for `compile_gluon_sm90`."""
    w, s, h = _nvfp4_gluon_parts.shared_layouts()
    words, codes = f"tensordesc<u8[64, 128],{w!r}>", f"tensordesc<i32[8, 32],{s!r}>"
    return {"g_d": words, "gs_d": codes, "u_d": words, "us_d": codes, "d_d": words,
            "ds_d": codes, "h_d": f"tensordesc<bf16[8, 64],{h!r}>",
            "x_d": f"tensordesc<bf16[1, 128],{_nvfp4_gate_up_gluon.x_layout()!r}>",
            "x_ptr": "*bf16", "expert_of_block_ptr": "*i32",
            "sorted_pair_ptr": "*i32", "gate_alpha_ptr": "*fp32", "up_alpha_ptr": "*fp32",
            "down_alpha_ptr": "*fp32", "h_ptr": "*bf16", "y_ptr": "*bf16", "count_ptr": "*i32"}


def check_lowering() -> None:
    """The kernel lowers for sm_90 with at most `MAXNREG` registers, no spills, at most the
    ring plus 1 KB of shared memory (what `programs_per_sm` assumes), and the PDL instructions
    of each launch form."""
    kernel, types = _nvfp4_moe_gluon._moe_gluon_kernel, fused_types()
    stages = _nvfp4_moe_gluon.STAGES
    for pdl, block_m, tickets, x_tma in (("enter", 16, 0, True), ("after", 16, 1, True),
                                         ("", 64, 1, False), ("enter", 16, 2, True)):
        consts = {"STAGES": stages, "H": 2048, "I": 512, "BLOCK_M": block_m,
                  "PDL_ENTER": pdl == "enter", "PDL_AFTER": pdl == "after", "TICKETS": tickets,
                  "X_TMA": x_tma}
        compiled, usage = compile_gluon_sm90(kernel, types, consts, _nvfp4_moe_gluon.MAXNREG)
        assert usage["REG"] <= _nvfp4_moe_gluon.MAXNREG and usage["LOCAL"] == 0, usage
        assert compiled.metadata.shared <= stages * _nvfp4_moe_gluon.STAGE_BYTES + 1024
        ptx = compiled.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") == (1 if pdl else 0), pdl
        assert ("griddepcontrol.launch_dependents" in ptx) == bool(pdl), pdl
        assert ptx.count("mma.sync.aligned.m16n8k16") >= 6  # gate, up (x2), down (x2 steps)
        assert ".reqntid 256" in ptx  # `THREADS`: what `programs_per_sm` counts registers for
        # exchanges: the last reader's two counter resets, and (tickets) the ticket reset; the
        # ticket increments (the first item, then one ahead; with 2 the first down item, then
        # one ahead) are relaxed adds
        assert ptx.count("relaxed.exch") == 2 + bool(tickets)
        assert ptx.count("relaxed.add") == 1 + 2 * bool(tickets)  # + the reader count
        assert 32 * compiled.metadata.num_warps == _nvfp4_moe_gluon.THREADS
        # TMA copies: gate, up, their codes (+ 8 x rows per K-step with `X_TMA`); down, per
        # ring slot (two, unrolled): two weight chunks, their codes, four h halves
        assert ptx.count("cp.async.bulk.tensor") == 4 + 8 * x_tma + 2 * 8, (pdl, x_tma)
    # gate/up items alone, self-routed (`_nvfp4_self_route`): 6 items per program of the
    # LLaDA2.1-mini routing (tables padded to 8 rows); the producer's copies are gate/up's
    # alone, and it waits for the alignment at one of two places (after its first item's
    # first copies, or at once without one), then lets the next launch start
    # alignment (two waits, two launch_dependents); `WAIT_FIRST` (the op's first launch,
    # `DLMC_NVFP4_ALIGN_AFTER`): a wait before the routing reads `ids_ptr` and a
    # launch_dependents after it, too
    for wait_first in (False, True):
        consts = {"STAGES": stages, "H": 2048, "I": 512, "BLOCK_M": 16, "PDL_ENTER": False,
                  "PDL_AFTER": False, "TICKETS": 0, "X_TMA": True, "SELF": True, "G": 6,
                  "PAIRS_PAD": 256, "EXPERTS_PAD": 256, "WAIT_FIRST": wait_first}
        compiled, usage = compile_gluon_sm90(kernel, types | {"ids_ptr": "*i32"}, consts,
                                             _nvfp4_moe_gluon.MAXNREG)
        assert usage["REG"] <= _nvfp4_moe_gluon.MAXNREG and usage["LOCAL"] == 0, usage
        assert compiled.metadata.shared <= stages * _nvfp4_moe_gluon.STAGE_BYTES + 1024
        ptx = compiled.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") == 2 + wait_first, wait_first
        assert ptx.count("griddepcontrol.launch_dependents") == 2 + wait_first, wait_first
        if wait_first:  # the wait comes before the routing's loads of the ids
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), wait_first
        assert ptx.count("cp.async.bulk.tensor") == 4 + 8
    # with the shared expert's items (`_nvfp4_shared_items`): three more copies per K-step
    # (gate, up, x), their MMAs, the release count, within the registers and without spills
    rows = _nvfp4_shared_items.ROWS_128.value
    boxes = {"sg_d": f"tensordesc<bf16[32, 64],{rows!r}>",
             "su_d": f"tensordesc<bf16[32, 64],{rows!r}>",
             "xs_d": f"tensordesc<bf16[32, 64],{rows!r}>"}
    compiled, usage = compile_gluon_sm90(kernel, types | {"ids_ptr": "*i32"} | boxes,
                                         consts | {"SHARED_ITEMS": True},
                                         _nvfp4_moe_gluon.MAXNREG)
    assert usage["REG"] <= _nvfp4_moe_gluon.MAXNREG and usage["LOCAL"] == 0, usage
    assert compiled.metadata.shared <= stages * _nvfp4_moe_gluon.STAGE_BYTES + 1024
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor") == 4 + 8 + 3
    assert ptx.count("atom.global.gpu.release.add") == 2  # routed and shared items' counts


def test_the_kernel_lowers_for_sm90() -> None:
    run_lowering_check("tests.custom_ops.test_nvfp4_moe_gluon")


def dequantized(experts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """`name` ("gate", "up", "down") dequantized to fp32 `[E, N, K]`, global scale included."""
    return dequantized_down({"down_weight": experts[f"{name}_weight"],
                             "down_weight_scale": experts[f"{name}_weight_scale"],
                             "down_weight_scale_2": experts[f"{name}_weight_scale_2"]})


def torch_fused(experts: dict[str, torch.Tensor], calls: list[str]):
    """A stand-in for `launch_moe_gluon` on the CPU: every routed pair's h row (even-odd
    columns, bf16) and y row (bf16) from x, blocks of the shared expert skipped; it also checks
    that the routed blocks' counters are zero at the launch (the shared parts' counters were
    zeroed by their down parts, which ran before it), with room for the ticket counter."""
    gate, up, down = (dequantized(experts, name) for name in ("gate", "up", "down"))

    def launch(x, sorted_pair, expert_of_block, weights, alphas, h, y, count, num_slots,
               num_pairs, shared_id, a_row_div, pdl="", gate_up_only=False, topk_ids=None):
        assert not gate_up_only  # the fused kernel: gate/up and down items
        calls.append(pdl)
        assert count.numel() >= 2 * num_slots + 1  # the ticket counter's room
        assert int(count[:2 * num_slots + 1].abs().sum()) == 0
        block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
        for block, expert in enumerate(expert_of_block.tolist()):
            if expert < 0 or expert == shared_id:
                continue
            for slot in range(block_m * block, block_m * block + block_m):
                pair = int(sorted_pair[slot])
                if pair >= num_pairs:
                    continue
                row = x[pair // a_row_div].float()
                g, u = gate[expert] @ row, up[expert] @ row
                natural = (g * torch.sigmoid(g) * u).bfloat16()
                h[slot] = natural.view(-1, 64, 2).transpose(1, 2).reshape(-1)  # even first
                y[pair] = (down[expert] @ natural.float()).bfloat16()

    return launch


@pytest.mark.parametrize("with_shared", [False, True])
def test_wiring_with_a_torch_fused_matches_the_reference(monkeypatch, with_shared: bool) -> None:
    """The Gluon launch comes last ("after" the shared expert's Triton parts, or "enter" right
    after the routing), the Triton kernels run the shared expert's parts alone, and the output
    is the reference's; skewed routing puts 20 tokens on two experts."""
    gen = torch.Generator().manual_seed(6)
    experts = random_experts(gen, 4, 128, 256)
    x = torch.randn(20, 128, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 20, 4, 2, skew=True)
    args = op_args(x, ids, w, experts)
    shared = {}
    if with_shared:
        shared = shared_expert(gen, x, nvfp4_moe_reference(*args), 128, 256)
    calls: list[str] = []
    counters = op_module.counters(torch.device(DEVICE), 1)
    monkeypatch.setattr(op_module, "fused_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "launch_moe_gluon", torch_fused(experts, calls))
    with contextlib.nullcontext():  # (v7)
        out = nvfp4_moe(*args, **shared)
    assert calls == ["after" if with_shared else "enter"]
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))
    assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "shared", "prompt"])
def test_fused_equals_the_triton_kernels_gpu(monkeypatch, case: str) -> None:
    """Bit for bit the Triton kernels: LLaDA2.1-mini shapes with uniform routing (32 x top-8 of
    256), every token on the same 8 experts (full blocks, both 8-slot parts), one token, with
    the shared expert's parts; a 256-token prompt chunk (64-slot routing blocks) up to
    summation order."""
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = (256, 2048, 512, 32) if case in ("llada", "shared") else (8, 256, 256, 16)
    T = {"one_token": 1, "prompt": 256}.get(case, T)
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8 if E > 8 else 4, skew=case == "skewed")
    shared = {}
    if case == "shared":
        shared = shared_expert(gen, x, nvfp4_moe_reference(*op_args(x, ids, w, experts)), H, I)
    out = against_triton(monkeypatch, "fused", experts, x, ids, w, shared, case != "prompt")
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts), **shared))


@pytest.mark.gpu
@pytest.mark.parametrize("tickets", [1, 2], ids=["all", "down"])
@pytest.mark.parametrize("case", ["llada", "shared"])
def test_fused_with_tickets_equals_the_triton_kernels_gpu(monkeypatch, case: str,
                                                          tickets: int) -> None:
    """Items handed out by the ticket counter (`TICKETS` 1; 2: the down items alone): the same
    output, and the counter zero again after the launch (with the routing's block counters)."""
    monkeypatch.setattr(_nvfp4_moe_gluon, "TICKETS", tickets)
    test_fused_equals_the_triton_kernels_gpu(monkeypatch, case)


@pytest.mark.gpu
def test_fused_replays_in_a_cuda_graph_gpu(monkeypatch) -> None:
    """Captured once, replayed on new x and routing: the eager Triton path's output, and the
    counters zero after each replay."""
    assert_graph_replays_like_triton(monkeypatch, "fused", 256)

