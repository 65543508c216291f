"""`DLMC_NVFP4_DOWN=gluon`: `nvfp4_moe`'s routed down projection in the Gluon kernel
(`_nvfp4_down_gluon`).

On CPU the Gluon kernel cannot run: there the switch's conditions are checked, the kernel's
sm_90 lowering of each form (registers, spills, atomics, PDL), and the op's wiring (gate/up
storing h even columns first per 128, the shared expert's down parts alone in the Triton
kernel) with the Gluon launch replaced by a torch computation that reads h the way the kernel
does. On the H200 the op's output with the Gluon kernel equals the Triton kernel's bit for bit,
eager and replayed in a CUDA graph, with its items by program or by ticket.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys

import pytest
import torch

import dlmc.custom_ops.nvfp4_moe as op_module
from dlmc.custom_ops import _nvfp4_down_gluon, _nvfp4_gluon_parts, _nvfp4_shared_items
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.errors import ConfigError
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

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def test_the_switch_names_bad_values_and_applies_only_on_hopper(monkeypatch) -> None:
    switch = _nvfp4_down_gluon._switch
    for name, bad, good, default in (("DLMC_NVFP4_DOWN", "cutlass", "fused", "gluon"),
                                     ("DLMC_NVFP4_DOWN_TICKETS", "yes", "0", "1"),
                                     ("DLMC_NVFP4_SHARED_DOWN", "down", "gate_up", "own"),
                                     ("DLMC_NVFP4_GATE_UP", "fused", "triton", "gluon")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=rf"{name}='{bad}': expected one of {default}, "):
            switch(name)
        monkeypatch.setenv(name, good)
        assert switch(name) == good
        monkeypatch.delenv(name)
        assert switch(name) == default  # gluon (where it applies), tickets, own parts, gluon
    monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "gluon")
    applies = _nvfp4_down_gluon.down_gluon_applies
    cpu = torch.device("cpu")
    assert not applies(cpu, 7, 2048, 512, False, True, 16)  # no GPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        cuda = torch.device("cuda")
        assert applies(cuda, 7, 2048, 512, False, True, 16)
        assert not applies(cuda, 7, 2048, 512, False, True, 32)  # prompt chunks: Triton
        assert not applies(cuda, 5, 2048, 512, False, True, 16)  # v5's forms
        assert not applies(cuda, 7, 2048, 512, True, True, 16)  # W4A4 emulation
    monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "triton")
    assert not applies(torch.device("cuda"), 7, 2048, 512, False, True, 16)  # switched off


def check_lowering() -> None:
    """Each launch form lowers for sm_90 within `MAXNREG` registers and without spills: no
    overlap; overlap with PDL; overlap with PDL and tickets (the producer spins for the rows,
    fences and copies them: `fence.proxy.async.global`; relaxed adds: the first ticket, one
    ahead per item, the reader count; exchanges: the last reader's two counter resets and the
    ticket reset). With tickets, `PER_PART` (waiting for gate/up's counts per 8-slot part) the
    same, and `SELF` (`_nvfp4_down_self_route`: the items routed from the ids, no alignment
    read: the kernel's only global loads are the ids, the alphas and the counters), also with
    a shared expert's y row after every 8 pairs (`PAIR_GAP`, `_nvfp4_shared_items`)."""
    kernel, types = _nvfp4_down_gluon._down_gluon_kernel, down_types()
    for overlap, tickets, per_part, self_routed, gap in ((False, False, False, False, 0),
                                                         (True, False, False, False, 0),
                                                         (True, True, False, False, 0),
                                                         (True, True, True, False, 0),
                                                         (True, True, True, True, 0),
                                                         (True, True, True, True, 8)):
        consts = {"STAGES": _nvfp4_down_gluon.STAGES, "KSTEPS": 4, "TILES": 16, "I": 512,
                  "H": 2048, "BLOCK_M": 16, "OVERLAP": overlap, "PDL": overlap,
                  "TICKETS": tickets, "PER_PART": per_part}
        if self_routed:
            consts |= {"SELF": True, "PAIRS_PAD": 256, "EXPERTS_PAD": 256, "PAIR_GAP": gap}
        compiled, usage = compile_gluon_sm90(kernel, types | {"ids_ptr": "*i32"}, consts,
                                             _nvfp4_down_gluon.MAXNREG)
        form = (overlap, tickets, per_part, self_routed, gap)
        assert usage["REG"] <= _nvfp4_down_gluon.MAXNREG, (form, usage)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (form, usage)
        ptx = compiled.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") == int(overlap), form
        assert ptx.count("relaxed.add") == int(overlap) + 2 * tickets, form
        assert ptx.count("relaxed.exch") == 2 * overlap + tickets, form
        assert ("fence.proxy.async.global" in ptx) == tickets, form
        assert ".reqntid 256" in ptx  # 3 programs per SM at 80 registers: 61440 of 65536
        if self_routed:  # the ids (16 B vectors of 4 lanes' ids), the alphas: no other loads
            assert ptx.count("ld.global") <= 6, (form, ptx.count("ld.global"))
    # with the shared expert's items (`_nvfp4_shared_items`): per K-step a down tile and an h
    # box (16 unrolled steps), within the registers, without spills
    rows = _nvfp4_shared_items.ROWS_64.value
    compiled, usage = compile_gluon_sm90(
        kernel, types | {"ids_ptr": "*i32", "sd_d": f"tensordesc<bf16[128, 32],{rows!r}>",
                         "hs_d": f"tensordesc<bf16[16, 32],{rows!r}>"},
        consts | {"SHARED_ITEMS": 32}, _nvfp4_down_gluon.MAXNREG)
    assert usage["REG"] <= _nvfp4_down_gluon.MAXNREG and usage["LOCAL"] == 0, usage
    assert usage["STACK"] == 0, usage
    assert compiled.asm["ptx"].count("cp.async.bulk.tensor") == 16 + 2 * 16


def down_types() -> dict[str, str]:
    """The Gluon down kernel's non-i32 argument types for `compile_gluon_sm90`."""
    w, s, h = _nvfp4_gluon_parts.shared_layouts()
    return {"w_d": f"tensordesc<u8[64, 128],{w!r}>", "s_d": f"tensordesc<i32[8, 32],{s!r}>",
            "h_d": f"tensordesc<bf16[8, 64],{h!r}>", "expert_of_block_ptr": "*i32",
            "sorted_pair_ptr": "*i32", "alpha_ptr": "*fp32", "y_ptr": "*bf16",
            "h_ptr": "*bf16", "count_ptr": "*i32"}


def compile_gluon_sm90(kernel, types: dict[str, str], consts: dict[str, object],
                       maxnreg: int) -> tuple[object, dict[str, int]]:
    """`kernel` lowered for sm_90 with 4 warps and `maxnreg` registers (arguments not in `types`
    are i32, `consts` are constexprs; constexprs left out, and arguments that default to None,
    take their defaults): the compiled kernel and its resource usage."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    from tests.custom_ops.test_kernels_compile_sm90 import resource_usage

    consts = {p.name: p.default for p in kernel.params
              if p.name not in types and (p.is_constexpr or p.default is None)
              and p.default is not inspect.Parameter.empty} | consts
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature |= dict.fromkeys(consts, "constexpr")
    compiled = triton_compile(GluonASTSource(kernel, signature, consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": maxnreg})
    return compiled, resource_usage(compiled)


def run_lowering_check(module: str, check: str = "check_lowering",
                       env: dict[str, str] | None = None) -> None:
    """`module.check()` in a fresh process without Triton's interpreter (the lowering needs the
    compiler's real backend), with `env` added to the environment."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    result = subprocess.run([sys.executable, "-c", f"from {module} import {check}; {check}()"],
                            env=env, timeout=300, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_each_form_lowers_for_sm90() -> None:
    run_lowering_check("tests.custom_ops.test_nvfp4_down_gluon")


def test_item_tags_must_fit_in_int32() -> None:
    """Ring slots tag items as `item * 1024 + expert`: the largest item and expert id that fit
    pass, one more of either is refused, naming the kernel."""
    check = _nvfp4_gluon_parts.check_item_tags
    check(2**21 - 1, 1024, "k")
    for items, experts in ((2**21, 8), (1, 1025)):
        with pytest.raises(ValueError, match=rf"k tags items .*{items} items .*{experts} experts"):
            check(items, experts, "k")


def test_tickets_need_a_counter_past_the_slots(monkeypatch) -> None:
    """With tickets the counter after the slots' must exist: a buffer of exactly
    `2 * num_slots` is refused, naming what to allocate."""
    monkeypatch.setattr(_nvfp4_down_gluon, "TICKETS", True)
    h = torch.zeros(32, 256, dtype=torch.bfloat16)
    words = torch.zeros(4, 256, 128, dtype=torch.uint8)
    codes = torch.zeros(4, 256, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"needs 5 counters .*num_slots \+ 1\)`\), got 4"):
        _nvfp4_down_gluon.launch_down_gluon(
            h, torch.zeros(32, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), words,
            codes, torch.ones(4), torch.zeros(8, 256, dtype=torch.bfloat16), 8, 4,
            count=torch.zeros(4, dtype=torch.int32), num_slots=2, writers=2)


@pytest.mark.parametrize("tickets,ids,inter", [(False, 8, 256), (True, 7, 256), (True, 8, 128)],
                         ids=["no_tickets", "wrong_ids", "one_k_step"])
def test_self_routing_needs_tickets_all_ids_and_two_k_steps(monkeypatch, tickets: bool,
                                                            ids: int, inter: int) -> None:
    """`topk_ids` (the down kernel routing its own items, `_nvfp4_down_self_route`) is refused,
    naming what it needs, without the ticket counter, with ids that are not the routing's
    `num_pairs`, or with one K-step (the consumers read gate/up's pairs after the second)."""
    monkeypatch.setattr(_nvfp4_down_gluon, "TICKETS", tickets)
    h = torch.zeros(32, inter, dtype=torch.bfloat16)
    words = torch.zeros(4, 256, inter // 2, dtype=torch.uint8)
    codes = torch.zeros(4, 256, inter // 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"self-routing needs the ticket counter, 8 ids and "
                                         rf"I >= 256 .*tickets={tickets}, {ids} ids, I={inter}"):
        _nvfp4_down_gluon.launch_down_gluon(
            h, torch.zeros(32, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), words,
            codes, torch.ones(4), torch.zeros(8, 256, dtype=torch.bfloat16), 8, 4,
            count=torch.zeros(5, dtype=torch.int32), num_slots=2, writers=2,
            topk_ids=torch.zeros(ids, dtype=torch.int32))


def even_odd_rows_to_natural(h: torch.Tensor) -> torch.Tensor:
    """Inverse of the gate/up kernel's `H_EVEN_ODD` store: each 128 columns even, then odd."""
    rows, cols = h.shape
    return h.reshape(rows, cols // 128, 2, 64).transpose(2, 3).reshape(rows, cols)


def torch_down(dequantized: torch.Tensor, calls: list[int]):
    """A stand-in for `launch_down_gluon` on the CPU: reads h as the kernel does (even-odd
    columns, the routing's blocks, blocks of the shared expert skipped) and writes y in bf16, with
    the down weights dequantized to fp32 `[E, H, I]` (alpha included)."""

    def launch(h, sorted_pair, expert_of_block, words, codes, alpha, y, num_pairs, shared_id,
               count=None, num_slots=0, writers=0, pdl=False, per_part=False, topk_ids=None):
        assert topk_ids is None  # (no PDL on the CPU: the alignment is launched)
        calls.append(1)
        natural = even_odd_rows_to_natural(h.float())
        block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
        for block, expert in enumerate(expert_of_block.tolist()):
            if expert < 0 or expert == shared_id:
                continue
            if count is not None:  # the per-block wait: gate/up signalled each of its programs
                # (`per_part`: each of its items, `writers` per 8-slot part that holds a pair)
                live = sum(int(sorted_pair[block * block_m + part]) < num_pairs
                           for part in range(0, block_m, 8))
                expected = writers * (live if per_part else 1)
                assert int(count[block]) == expected and int(count[num_slots + block]) == 0
                count[block] = 0  # the last reader's zeroing
            for slot in range(block_m * block, block_m * block + block_m):
                pair = int(sorted_pair[slot])
                if pair < num_pairs:
                    y[pair] = (dequantized[expert] @ natural[slot]).bfloat16()

    return launch


def dequantized_down(experts: dict[str, torch.Tensor]) -> torch.Tensor:
    codes = experts["down_weight"]  # uint8 [E, H, I/2]: low nibble first
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:2], -1).long()
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    scale = experts["down_weight_scale"].float().repeat_interleave(16, dim=-1)
    return e2m1[nibbles] * scale * experts["down_weight_scale_2"].float().reshape(-1, 1, 1)


@pytest.mark.parametrize(("with_shared", "gate_up_block_n", "shared_down"),
                         [(False, 128, "own"), (True, 128, "own"), (True, 128, "gate_up"),
                          (False, 64, "own")])
def test_wiring_with_a_torch_down_matches_the_reference(monkeypatch, with_shared: bool,
                                                        gate_up_block_n: int,
                                                        shared_down: str) -> None:
    """gate/up's even-odd h rows (reordered in registers in its 128-column N-tiles), read back
    by the stand-in, and the shared expert's down parts in the Triton kernel (`PARTS_ONLY`)
    give the reference's output; skewed routing puts 20 tokens on two experts (two 16-slot
    blocks each). With the per-slot counters (on by default; the interpreter runs them too)
    every routed block was signalled by all its gate/up programs, and the counters are zero
    afterwards. Narrower gate/up N-tiles (a launch-config override) keep the Triton down
    kernel. `shared_down` "gate_up": the shared expert's down parts run as the last programs
    of gate/up's launch (one N-tile column here, which the interpreter runs in order)."""
    monkeypatch.setitem(op_module._GATE_UP_BLOCK_N, 7, gate_up_block_n)
    monkeypatch.setattr(_nvfp4_down_gluon, "SHARED_DOWN", shared_down)
    gen = torch.Generator().manual_seed(3)
    hidden = 256 if shared_down == "gate_up" else 128  # (two down N-tiles per shared part)
    experts = random_experts(gen, 4, hidden, 128)
    x = torch.randn(20, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 20, 4, 2, skew=True)
    args = op_args(x, ids, w, experts)
    shared = {}
    if with_shared:
        shared = shared_expert(gen, x, nvfp4_moe_reference(*args), hidden, 128)
    calls: list[int] = []
    counters = op_module.counters(torch.device(DEVICE), 1)
    monkeypatch.setattr(op_module, "down_gluon_applies", lambda *a: True)
    monkeypatch.setattr(op_module, "launch_down_gluon", torch_down(dequantized_down(experts),
                                                                   calls))
    launched: list[str] = []  # the Triton kernels the op launches
    real_launcher = op_module.launcher
    monkeypatch.setattr(op_module, "launcher", lambda kernel: (
        launched.append(kernel.fn.__name__), real_launcher(kernel))[1])
    with contextlib.nullcontext():  # (v7)
        out = nvfp4_moe(*args, **shared)
    assert calls == ([1] if gate_up_block_n == 128 else [])
    # the Triton down kernel: the routed blocks without the Gluon kernel, else the shared
    # expert's parts unless gate/up's launch ran them
    triton_down = gate_up_block_n != 128 or (with_shared and shared_down == "own")
    assert ("_down_kernel" in launched) == triton_down, launched
    assert "_gate_up_kernel" in launched
    assert_matches_reference(out, nvfp4_moe_reference(*args, **shared))
    assert int(counters.abs().sum()) == 0  # zero again between launches (`moe_overlap`)


def against_triton(monkeypatch, mode: str, experts, x, ids, w, shared,
                   bitwise: bool = True) -> torch.Tensor:
    """`nvfp4_moe` with `DLMC_NVFP4_DOWN=mode` against the Triton kernels: bit for bit
    (`bitwise`), or up to summation order (the fused kernel with 64-slot blocks: the Triton
    kernels' 64-row tiles sum in another order, perf/README.md session 25); `moe_overlap`'s
    counters zero afterwards."""
    args = op_args(x, ids, w, stored(experts))
    with contextlib.nullcontext():  # (v7)
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "triton")
        triton_out = nvfp4_moe(*args, **shared)
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", mode)
        out = nvfp4_moe(*args, **shared)
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "triton")
    if bitwise:
        assert torch.equal(bits(out), bits(triton_out))
    else:
        assert_matches_reference(out, triton_out)
    assert int(op_module.counters(x.device, 1).abs().sum()) == 0
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tickets", [True, False], ids=["tickets", "by_program"])
@pytest.mark.parametrize("case", ["llada", "skewed", "one_token", "shared"])
def test_gluon_down_equals_triton_down_gpu(monkeypatch, case: str, tickets: bool) -> None:
    """Bit for bit the Triton down kernel: LLaDA2.1-mini shapes with uniform routing (32 x
    top-8 of 256), every token on the same 8 experts (16-slot blocks full: both 8-slot parts),
    one token, and with the shared expert's parts (in the routing: the shared items, which
    `test_nvfp4_shared_items.py` tests, off); items by ticket (the producer waits for gate/up's
    rows and copies them) or by program; the counters zero again afterwards."""
    monkeypatch.setattr(_nvfp4_down_gluon, "TICKETS", tickets)
    monkeypatch.setattr(_nvfp4_shared_items, "SHARED_ITEMS", False)
    gen = torch.Generator().manual_seed(4)
    E, H, I, T = (256, 2048, 512, 32) if case in ("llada", "shared") else (8, 256, 128, 16)
    T = 1 if case == "one_token" else T
    experts = {k: v.to(DEVICE) for k, v in random_experts(gen, E, H, I).items()}
    x = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, T, E, 8, skew=case == "skewed")
    shared = {}
    if case == "shared":
        shared = shared_expert(gen, x, nvfp4_moe_reference(*op_args(x, ids, w, experts)), H, I)
    out = against_triton(monkeypatch, "gluon", experts, x, ids, w, shared)
    assert_matches_reference(out, nvfp4_moe_reference(*op_args(x, ids, w, experts), **shared))


def assert_graph_replays_like_triton(monkeypatch, mode: str, inter: int,
                                     with_shared: bool = False) -> None:
    """`nvfp4_moe` with `DLMC_NVFP4_DOWN=mode` (and a shared expert), captured once and replayed
    on new x and routing, gives the eager Triton path's output bit for bit, and leaves
    `moe_overlap`'s counters zero."""
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
    with contextlib.nullcontext():  # (v7)
        monkeypatch.setattr(_nvfp4_down_gluon, "MODE", mode)
        nvfp4_moe(*static, **shared)  # warm (compiles the kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = nvfp4_moe(*static, **shared)
        for source in (args_of[1], args_of[0]):
            for dst, src in zip(static[:3], source[:3], strict=True):
                dst.copy_(src)
            graph.replay()
            monkeypatch.setattr(_nvfp4_down_gluon, "MODE", "triton")
            expected = nvfp4_moe(*source, **shared)
            monkeypatch.setattr(_nvfp4_down_gluon, "MODE", mode)
            assert torch.equal(bits(out), bits(expected))
            assert int(op_module.counters(out.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tickets", [True, False], ids=["tickets", "by_program"])
def test_gluon_down_replays_in_a_cuda_graph_gpu(monkeypatch, tickets: bool) -> None:
    """Captured once, replayed on new x and routing: the eager Triton path's output."""
    monkeypatch.setattr(_nvfp4_down_gluon, "TICKETS", tickets)
    assert_graph_replays_like_triton(monkeypatch, "gluon", 128)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["shared", "replay"])
def test_shared_down_parts_in_gate_up_equal_triton_gpu(monkeypatch, case: str) -> None:
    """`DLMC_NVFP4_SHARED_DOWN=gate_up`: the shared expert's down parts as the last programs
    of gate/up's launch (no launch between gate/up and the Gluon kernel): the Triton path's
    output bit for bit, eager at LLaDA2.1-mini shapes and replayed in a CUDA graph."""
    monkeypatch.setattr(_nvfp4_down_gluon, "SHARED_DOWN", "gate_up")
    if case == "shared":
        test_gluon_down_equals_triton_down_gpu(monkeypatch, "shared", True)
    else:
        assert_graph_replays_like_triton(monkeypatch, "gluon", 128, with_shared=True)
