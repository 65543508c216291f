"""Prototype: the NVFP4 gate/up projection (+ SiLU-mul) as a persistent, warp-specialized Gluon
kernel with the weights as the MMA's A operand, next to the Triton (v7) gate/up kernel.

The down kernel built this way (`custom_ops/_nvfp4_down_gluon.py`) is 15 % faster than v7's
(29.4 against 34.9 µs per LLaDA2.1-mini layer, perf/README.md session 24): half the `HMMA`s,
since ~1.6 tokens per expert fill an 8-slot B operand as well as a 16-row A. Gate/up is the
larger kernel (about 60 µs per layer). Work items: (8-slot part of a 16-slot routing block,
128-row N-tile of I); per K-step (16 of them at H 2048) the producer warp copies the gate and
up chunks (8 KB each, v7's words) and their codes (1 KB each) with TMA; the consumer warps load
the part's x rows (gathered by token, the next K-step's ahead), split them into even / odd K
in registers (the B operands of the low- and high-nibble MMAs), decode both weight chunks with
v7's asm and accumulate gate and up; the epilogue writes `silu(gate) * up` in bf16, each
128-column step's even columns first (what the Gluon down kernel reads). Routed experts only
(the op runs the shared expert's parts in the Triton kernel).

    python3 perf/proto_gluon_gate_up.py --compile-only       # CPU: lower for sm_90
    python3 perf/proto_gluon_gate_up.py --out perf/results/sNN/proto_gluon_gate_up.json  # H200

Session 25 (H200, call 2): bit for bit v7; 57.5 µs per layer at 3 stages and 3 programs per
SM (80 registers) against v7's 58.2, 90-98 µs with 2 programs per SM. The op's fused kernel
(`custom_ops/_nvfp4_moe_gluon.py`) grew from it; the consumer's work per item is now the fused
kernel's `_gate_up_item` without the counter (the same code as call 2 measured, moved).

Session 26 (calls 3-5), µs per layer, two repeats each:
- `PROBE` forms (commit 5428d2d; timing only): as is 58.1 / 59.4; x rows not loaded 53.3 /
  53.4; no decode 49.4 / 49.4; neither 47.6 / 47.8 (about copy speed). The consumer warps'
  x loads and the decode (with its scale codes) hold the kernel, not the copies.
- x rows by the producer's TMA copies (`X_TMA`, config `3,3,80,0,1`): 55.5 / 55.7 against
  57.6 / 57.6 without (v7 57.3 / 57.6), bit for bit; in another call 57.0 / 57.4 (v7 57.8 /
  58.5). 4 programs per SM at 64 registers (2 stages): 74.4 / 75.4.

Session 27 (call 2, three repeats): 8 consumer warps (config `S,2,80,0,1,8`: two programs of
384 threads per SM, 104 registers per consumer thread, no spills) are much slower, bit for bit:
3 stages 71.5 / 107.1 / 107.6, 4 stages 70.8 / 106.6 / 71.6, 2 stages 84.9 / 85.2 / 85.3 µs
per layer, against v7's 57.5-57.7 (the 4-warp row of that call did not run: a parsing bug in
`--configs`, fixed since). Fewer items in flight per SM cost more than the extra warps give.
The `SPLIT` form (call 9, config `3,3,80,0,1,1`: four one-warp consumer partitions, each a
32-row quarter arriving on the empty barrier itself, the producer in the 4-warp default
partition that Gluon requires): bit for bit, 97.2-98.8 against 56.4-57.4 µs (4 warps); there
every mbarrier operation and copy of the producer is a 128-thread `bar.sync`. A one-warp
producer beside an idle default partition makes 384 threads: 2 programs per SM at 80
registers, or spills at 56.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import triton
from offline_sass import disassemble, print_rows, replay_times, require_mbarrier_ring, run
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dlmc.custom_ops._nvfp4_gate_up_gluon import (
    X_L,
    _gate_up_item,
    gate_up_copies,
    x_layout,
    x_operands,
    x_ring,
    x_rows_layout,
    x_step,
)
from dlmc.custom_ops._nvfp4_gluon_parts import (
    MMA,
    PLAIN2,
    TAGS,
    W_BYTES,
    W_OP,
    _chunk,
    _item,
    _mma_chunk,
    _store_tile,
    chunk_rings,
    mma_layout,
    ring_barriers,
    shared_layouts,
)

H, I, BM, K_TOP = 2048, 512, 16, 8
KSTEPS, TILES = H // 128, I // 128


@gluon.jit
def _producer(g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
              num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf, x_buf,
              ids, STAGES: gl.constexpr, KSTEPS: gl.constexpr, TILES: gl.constexpr,
              H: gl.constexpr, BLOCK_M: gl.constexpr, X_TMA: gl.constexpr,
              TAG: gl.constexpr = True):
    """The copies of the program's items (`TAG`: each slot tagged, in `ids`)."""
    i = 0  # K-steps copied so far (the ring position)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if has_work:
            i = gate_up_copies(g_d, gs_d, u_d, us_d, expert * TILES + tile, i, empty, ready,
                               g_buf, gs_buf, u_buf, us_buf, ids, 0, STAGES, H, x_d, x_buf,
                               sorted_pair_ptr, slot0, num_pairs, a_row_div, X_TMA, TAG)


# `PROBE` forms (timing only, wrong values): 1 x rows not loaded (a constant), 2 the decode
# replaced by moves (the words' bits as bf16), 3 both; what is left of the consumer's time
# says what holds it
_MOVES = gl.constexpr("mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;")


@gluon.jit
def _probe_chunk(words, codes, b_even, b_odd, acc, DECODE: gl.constexpr):
    """`_mma_chunk`, or (not `DECODE`) with the words' bits moved as they are."""
    if DECODE:
        return _mma_chunk(words, codes, b_even, b_odd, acc)
    lo, hi = gl.inline_asm_elementwise(_MOVES, "=r,=r,=r,=r,r", [words],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    acc = mma_v2(gl.convert_layout(gl.reshape(lo, [128, 64]), W_OP), b_even, acc)
    return mma_v2(gl.convert_layout(gl.reshape(hi, [128, 64]), W_OP), b_odd, acc)


@gluon.jit
def _probe_item(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr, num_pairs,
                stride_x, stride_h, a_row_div, slot0, tile, expert, i, empty, ready, g_buf,
                gs_buf, u_buf, us_buf, STAGES: gl.constexpr, H: gl.constexpr,
                PROBE: gl.constexpr):
    """`_nvfp4_gate_up_gluon._gate_up_item` (no counter) in a `PROBE` form."""
    alpha_g = gl.load(gate_alpha_ptr + expert) * 128.0
    alpha_u = gl.load(up_alpha_ptr + expert) * 128.0
    pairs_x = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(1, X_L)))
    rows = gl.where(pairs_x < num_pairs, pairs_x // a_row_div, 0).to(gl.int64)
    pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)))
    acc_g = gl.zeros([128, 8], gl.float32, MMA)
    acc_u = gl.zeros([128, 8], gl.float32, MMA)
    x = gl.full([8, 128], 0.5, gl.bfloat16, X_L)
    if PROBE % 2 == 0:
        x_next = x_step(x_ptr, rows, stride_x, 0)
    for k in range(H // 128):
        if PROBE % 2 == 0:
            x = x_next
            if k + 1 < H // 128:
                x_next = x_step(x_ptr, rows, stride_x, k + 1)
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        g_words, g_codes = _chunk(g_buf.index(s), gs_buf.index(s))
        u_words, u_codes = _chunk(u_buf.index(s), us_buf.index(s))
        fence_async_shared()
        mbarrier.arrive(empty.index(s), count=1)
        x_even, x_odd = x_operands(x)
        acc_g = _probe_chunk(g_words, g_codes, x_even, x_odd, acc_g, PROBE < 2)
        acc_u = _probe_chunk(u_words, u_codes, x_even, x_odd, acc_u, PROBE < 2)
        i += 1
    g = acc_g * alpha_g
    h = (g * (1.0 / (1.0 + gl.exp(-g))) * (acc_u * alpha_u)).to(gl.bfloat16)
    n = gl.arange(0, 128, gl.SliceLayout(1, MMA))
    cols = tile * 128 + (n % 2) * 64 + n // 2
    _store_tile(h_ptr, slot0 + gl.arange(0, 8, gl.SliceLayout(0, MMA)), stride_h, cols, h,
                pairs < num_pairs)
    return i


@gluon.jit
def _consumer(x_ptr, expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
              num_items, num_pairs, shared_id, stride_x, stride_h, a_row_div, empty, ready,
              g_buf, gs_buf, u_buf, us_buf, x_buf, STAGES: gl.constexpr, TILES: gl.constexpr,
              H: gl.constexpr, BLOCK_M: gl.constexpr, PROBE: gl.constexpr,
              X_TMA: gl.constexpr, WARPS: gl.constexpr):
    i = 0  # K-steps consumed so far
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if PROBE == 0:  # the fused kernel's gate/up item, without its counter
            if has_work:
                i = _gate_up_item(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                                  h_ptr, num_pairs, stride_x, stride_h, a_row_div, slot0,
                                  tile, expert, i, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                                  STAGES, H, BLOCK_M, False, x_buf, X_TMA, WARPS)
        elif has_work:  # (4 warps)
            i = _probe_item(x_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                            num_pairs, stride_x, stride_h, a_row_div, slot0, tile, expert, i,
                            empty, ready, g_buf, gs_buf, u_buf, us_buf, STAGES, H, PROBE)


@gluon.jit
def gate_up_gluon(g_d, gs_d, u_d, us_d, x_d, x_ptr, expert_of_block_ptr, sorted_pair_ptr,
                  gate_alpha_ptr, up_alpha_ptr, h_ptr, num_items, num_pairs, shared_id,
                  stride_x, stride_h, a_row_div, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                  TILES: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                  PROBE: gl.constexpr = 0, X_TMA: gl.constexpr = False,
                  WARPS: gl.constexpr = 4):
    """`X_TMA`: the producer copies the part's x rows into the ring (`x_d`: x's [1, 128]
    boxes); else the consumer warps load them from global memory. `WARPS`: the consumer
    warps (the launch's `num_warps`: 4, or 8 with `PROBE` 0)."""
    g_buf, u_buf, gs_buf, us_buf = chunk_rings(g_d, u_d, gs_d, us_d, STAGES)
    ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], TAGS)  # the copies' tags (unread)
    x_buf = x_ring(x_d, g_buf, STAGES, X_TMA)
    empty, ready = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (x_ptr, expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr,
                     h_ptr, num_items, num_pairs, shared_id, stride_x, stride_h, a_row_div,
                     empty, ready, g_buf, gs_buf, u_buf, us_buf, x_buf, STAGES, TILES, H,
                     BLOCK_M, PROBE, X_TMA, WARPS)),
        (_producer, (g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
                     num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf, us_buf,
                     x_buf, ids, STAGES, KSTEPS, TILES, H, BLOCK_M, X_TMA)),
    ], [1], [40])


# `SPLIT` form (session 27): the consumers as four one-warp partitions, each a 32-row quarter
# of the item's 128 rows (no barrier across consumer warps: each arrives on `empty` itself,
# which counts four arrivals), the producer in the default partition (four warps, one of which
# issues the copies). Layouts of a quarter: the chunk's [16, 128] bytes (row r = weight rows
# 2r, 2r+1 of the quarter) -> words [32, 8, 2, 4] (registers: byte, n bit 3, block bits 1-2,
# n bit 4; lanes: half, block bit 0, n bits 0-2) -> the one-warp MMA's A operand.
Q_CHUNK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [4, 0], [0, 16], [0, 32], [8, 0]],
    lane_bases=[[0, 4], [0, 8], [0, 64], [1, 0], [2, 0]], warp_bases=[], block_bases=[],
    shape=[16, 128]))
Q_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0],
               [16, 0, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[], block_bases=[], shape=[32, 8, 2, 4]))
Q_CODES = gl.constexpr(gl.SliceLayout(2, gl.SliceLayout(3, Q_WORDS.value)))


@gluon.jit
def _quarter_chunk(w_slot, s_slot, Q: gl.constexpr):
    """Quarter Q of a ring slot's weight chunk: bytes [32, 8, 2, 4] and codes [32, 8]."""
    words = w_slot._reinterpret(gl.uint8, [64, 128], W_BYTES).slice(16 * Q, 16).load(Q_CHUNK)
    words = gl.convert_layout(gl.reshape(words, [32, 8, 2, 4]), Q_WORDS)
    codes = s_slot._reinterpret(gl.uint8, [128, 8], PLAIN2).slice(32 * Q, 32).load(Q_CODES)
    return words, codes


@gluon.jit
def _quarter(expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
             num_items, num_pairs, shared_id, stride_h, empty, ready, g_buf, gs_buf, u_buf,
             us_buf, x_buf, STAGES: gl.constexpr, TILES: gl.constexpr, H: gl.constexpr,
             BLOCK_M: gl.constexpr, Q: gl.constexpr):
    """The gate/up items' rows 32 Q .. 32 Q + 31 (one warp)."""
    mma: gl.constexpr = mma_layout(1)
    i = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        slot0, tile, expert, has_work = _item(expert_of_block_ptr, sorted_pair_ptr, item,
                                              num_items, num_pairs, shared_id, TILES, BLOCK_M)
        if has_work:
            alpha_g = gl.load(gate_alpha_ptr + expert) * 128.0
            alpha_u = gl.load(up_alpha_ptr + expert) * 128.0
            pairs = gl.load(sorted_pair_ptr + slot0 + gl.arange(0, 8, gl.SliceLayout(0, mma)))
            acc_g = gl.zeros([32, 8], gl.float32, mma)
            acc_u = gl.zeros([32, 8], gl.float32, mma)
            for _ in range(H // 128):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                g_words, g_codes = _quarter_chunk(g_buf.index(s), gs_buf.index(s), Q)
                u_words, u_codes = _quarter_chunk(u_buf.index(s), us_buf.index(s), Q)
                x = x_buf.index(s).load(x_rows_layout(1))
                fence_async_shared()
                mbarrier.arrive(empty.index(s), count=1)
                x_even, x_odd = x_operands(x, 1)
                acc_g = _mma_chunk(g_words, g_codes, x_even, x_odd, acc_g, 1)
                acc_u = _mma_chunk(u_words, u_codes, x_even, x_odd, acc_u, 1)
                i += 1
            g = acc_g * alpha_g
            h = (g * (1.0 / (1.0 + gl.exp(-g))) * (acc_u * alpha_u)).to(gl.bfloat16)
            n = 32 * Q + gl.arange(0, 32, gl.SliceLayout(1, mma))
            cols = tile * 128 + (n % 2) * 64 + n // 2
            _store_tile(h_ptr, slot0 + gl.arange(0, 8, gl.SliceLayout(0, mma)), stride_h, cols,
                        h, pairs < num_pairs)


@gluon.jit
def gate_up_split(g_d, gs_d, u_d, us_d, x_d, x_ptr, expert_of_block_ptr, sorted_pair_ptr,
                  gate_alpha_ptr, up_alpha_ptr, h_ptr, num_items, num_pairs, shared_id,
                  stride_x, stride_h, a_row_div, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
                  TILES: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                  REGS: gl.constexpr = 120):
    """The `SPLIT` form (x rows by TMA; launched with 4 warps: the producer's)."""
    g_buf, u_buf, gs_buf, us_buf = chunk_rings(g_d, u_d, gs_d, us_d, STAGES)
    x_buf = x_ring(x_d, g_buf, STAGES, True)
    empty, ready = ring_barriers(STAGES, 4)
    gl.warp_specialize([
        (_producer, (g_d, gs_d, u_d, us_d, x_d, expert_of_block_ptr, sorted_pair_ptr, num_items,
                     num_pairs, shared_id, a_row_div, empty, ready, g_buf, gs_buf, u_buf,
                     us_buf, x_buf, empty, STAGES, KSTEPS, TILES, H, BLOCK_M, gl.constexpr(True),
                     gl.constexpr(False))),
        (_quarter, (expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                    num_items, num_pairs, shared_id, stride_h, empty, ready, g_buf, gs_buf,
                    u_buf, us_buf, x_buf, STAGES, TILES, H, BLOCK_M, gl.constexpr(0))),
        (_quarter, (expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                    num_items, num_pairs, shared_id, stride_h, empty, ready, g_buf, gs_buf,
                    u_buf, us_buf, x_buf, STAGES, TILES, H, BLOCK_M, gl.constexpr(1))),
        (_quarter, (expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                    num_items, num_pairs, shared_id, stride_h, empty, ready, g_buf, gs_buf,
                    u_buf, us_buf, x_buf, STAGES, TILES, H, BLOCK_M, gl.constexpr(2))),
        (_quarter, (expert_of_block_ptr, sorted_pair_ptr, gate_alpha_ptr, up_alpha_ptr, h_ptr,
                    num_items, num_pairs, shared_id, stride_h, empty, ready, g_buf, gs_buf,
                    u_buf, us_buf, x_buf, STAGES, TILES, H, BLOCK_M, gl.constexpr(3))),
    ], [1, 1, 1, 1], [REGS, REGS, REGS, REGS])


def compile_only(args: argparse.Namespace) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    w, s, _ = shared_layouts()
    wd, sd = f"tensordesc<u8[64, 128],{w!r}>", f"tensordesc<i32[8, 32],{s!r}>"
    sig = {"g_d": wd, "gs_d": sd, "u_d": wd, "us_d": sd,
           "x_d": f"tensordesc<bf16[1, 128],{x_layout()!r}>", "x_ptr": "*bf16",
           "expert_of_block_ptr": "*i32", "sorted_pair_ptr": "*i32", "gate_alpha_ptr": "*fp32",
           "up_alpha_ptr": "*fp32", "h_ptr": "*bf16", "num_items": "i32", "num_pairs": "i32",
           "shared_id": "i32", "stride_x": "i32", "stride_h": "i32", "a_row_div": "i32"}
    consts = {"STAGES": args.stages, "KSTEPS": KSTEPS, "TILES": TILES, "H": H, "BLOCK_M": BM,
              "PROBE": args.probe, "X_TMA": bool(args.x_tma), "WARPS": args.warps}
    sig |= dict.fromkeys(consts, "constexpr")
    compiled = triton.compile(GluonASTSource(gate_up_gluon, sig, consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": args.warps, "maxnreg": args.maxnreg})
    sass, usage = disassemble(compiled)
    ops = {op: sass.count(op) for op in ("HMMA", "LDS", "STS", "SHFL", "PRMT", "LDG", "STG",
                                         "UTMALDG", "STL", "LDL")}
    return {"shared": compiled.metadata.shared, "usage": usage.strip().splitlines()[-1].strip(),
            "ops": ops}


def run_gpu(args: argparse.Namespace) -> dict:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dlmc.bench.timing import copy_bandwidth_gbps
    from dlmc.custom_ops._nvfp4_moe_kernels import _gate_up_kernel
    from dlmc.custom_ops.moe_align import route_pairs

    E, L, T = 256, 19, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    w_l, s_l, _ = shared_layouts()
    layers = []
    for _ in range(L):
        lay = {}
        for name in ("gate", "up"):
            lay[name] = torch.randint(-2**31, 2**31 - 1, (E, I, H // 8), device="cuda",
                                      dtype=torch.int32, generator=gen)
            lay[name + "_codes"] = torch.randint(0, 144, (E, I, H // 16), device="cuda",
                                                 dtype=torch.int32, generator=gen).to(torch.int8)
            lay[name + "_alpha"] = torch.rand(E, device="cuda", generator=gen) * 1e-3
            lay[name + "_d"] = TensorDescriptor.from_tensor(
                lay[name].view(torch.uint8).view(-1, 128), [64, 128], w_l)
            lay[name + "_sd"] = TensorDescriptor.from_tensor(
                lay[name + "_codes"].view(torch.int32).view(-1, 32), [8, 32], s_l)
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K_TOP]
        block_m, lay["sorted_pair"], lay["expert_of_block"] = route_pairs(ids.to(torch.int32), E)
        assert block_m == BM, block_m
        S = lay["expert_of_block"].shape[0] * BM
        lay["x"] = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        lay["x_d"] = TensorDescriptor.from_tensor(lay["x"], [1, 128], x_layout())
        lay["h_ref"] = torch.zeros(S, I, dtype=torch.bfloat16, device="cuda")
        lay["h_new"] = torch.zeros_like(lay["h_ref"])
        lay["valid"] = lay["sorted_pair"] < T * K_TOP
        layers.append(lay)

    def v7() -> None:
        for lay in layers:
            nb = lay["expert_of_block"].shape[0]
            _gate_up_kernel[(nb, TILES)](
                lay["x"], lay["sorted_pair"], lay["expert_of_block"],
                lay["gate"].view(torch.uint8), lay["gate_codes"].view(torch.uint8),
                lay["up"].view(torch.uint8), lay["up_codes"].view(torch.uint8),
                lay["gate_alpha"], lay["up_alpha"], lay["h_ref"], T * K_TOP, K_TOP, H, I,
                lay["x"].stride(0), lay["h_ref"].stride(0), lay["x"], lay["x"], E, nb, K_TOP,
                lay["expert_of_block"], BLOCK_M=BM, BLOCK_N=128, BLOCK_K=128,
                INTERPRETED=False, VARIANT=7, SHARED=False, SHARED_BLOCK_K=128, SHARED_SPLIT=1,
                num_warps=4, num_stages=3)

    def gluon_run(stages: int, per_sm: int, maxnreg: int, probe: int = 0,
                  x_tma: int = 0, warps: int = 4) -> None:
        for lay in layers:
            nb = lay["expert_of_block"].shape[0]
            args = (lay["gate_d"], lay["gate_sd"], lay["up_d"], lay["up_sd"], lay["x_d"],
                    lay["x"], lay["expert_of_block"], lay["sorted_pair"], lay["gate_alpha"],
                    lay["up_alpha"], lay["h_new"], nb * 2 * TILES, T * K_TOP, E,
                    lay["x"].stride(0), lay["h_new"].stride(0), K_TOP)
            if warps == 1:  # the `SPLIT` form: four one-warp consumer partitions
                gate_up_split[(num_sms * per_sm,)](
                    *args, STAGES=stages, KSTEPS=KSTEPS, TILES=TILES, H=H, BLOCK_M=BM,
                    num_warps=4, maxnreg=maxnreg)
            else:
                gate_up_gluon[(num_sms * per_sm,)](
                    *args, STAGES=stages, KSTEPS=KSTEPS, TILES=TILES, H=H, BLOCK_M=BM,
                    PROBE=probe, X_TMA=bool(x_tma), WARPS=warps, num_warps=warps,
                    maxnreg=maxnreg)

    touched = sum(int(torch.unique(lay["expert_of_block"][lay["expert_of_block"] >= 0]).numel())
                  for lay in layers)
    nbytes = touched * 2 * (I * H // 2 + I * H // 16)  # gate + up weight and code bytes
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "argv": sys.argv, "layers": L,
              "experts_touched_per_layer": touched / L,
              "copy_GBps": copy_bandwidth_gbps(1 << 30, 30), "rows": []}
    v7()
    torch.cuda.synchronize()
    for repeat in range(args.repeats):
        ms = statistics.median(replay_times(v7, args.iters))
        report["rows"].append({"kernel": "v7 gate/up (Triton)", "repeat": repeat,
                               "us_per_layer": ms * 1e3 / L, "GBps": nbytes / (ms * 1e-3) / 1e9})
        for stages, per_sm, maxnreg, *extra in args.configs:
            probe, x_tma, warps = list(extra) + [0, 0, 4][len(extra):]
            row = {"kernel": "gluon gate/up", "stages": stages, "ctas_per_sm": per_sm,
                   "maxnreg": maxnreg, "probe": probe, "x_tma": x_tma, "warps": warps,
                   "repeat": repeat}
            try:
                gluon_run(stages, per_sm, maxnreg, probe, x_tma, warps)
                torch.cuda.synchronize()
                equal = True
                for lay in layers:  # even-odd columns back to natural order, valid rows
                    S = lay["h_new"].shape[0]
                    natural = lay["h_new"].view(S, TILES, 2, 64).transpose(2, 3).reshape(S, I)
                    equal &= torch.equal(natural[lay["valid"]].view(torch.int16),
                                         lay["h_ref"][lay["valid"]].view(torch.int16))
                ms = statistics.median(replay_times(
                    lambda s=stages, p=per_sm, m=maxnreg, q=probe, t=x_tma, w=warps: gluon_run(
                        s, p, m, q, t, w),
                    args.iters))
                row |= {"us_per_layer": ms * 1e3 / L, "GBps": nbytes / (ms * 1e-3) / 1e9,
                        "bit_equal_to_v7": equal}
            except Exception as error:  # a config that does not compile or launch
                row["error"] = repr(error)[:400]
            report["rows"].append(row)
    return print_rows(report, nbytes / L)


def main() -> None:
    require_mbarrier_ring("proto_gluon_gate_up.py")  # its probe and SPLIT consumers
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--maxnreg", type=int, default=96)
    parser.add_argument("--configs", nargs="+", default=[(4, 2, 96), (3, 3, 80), (6, 2, 96)],
                        type=lambda text: tuple(int(v) for v in text.split(",")),
                        help="stages,ctas_per_sm,maxnreg[,probe[,x_tma[,warps]]] (probe 1: "
                             "no x loads, 2: no decode, 3: neither; timing only; x_tma 1: x "
                             "rows by the producer's TMA copies; warps: consumer warps, 4 or 8 "
                             "(8 only with probe 0), or 1: four one-warp consumer partitions "
                             "(the SPLIT form, x by TMA))")
    parser.add_argument("--probe", type=int, default=0, help="--compile-only: the PROBE form")
    parser.add_argument("--x-tma", type=int, default=0, help="--compile-only: X_TMA")
    parser.add_argument("--warps", type=int, default=4, choices=(4, 8),
                        help="--compile-only: consumer warps")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    run(parser, compile_only, run_gpu)


if __name__ == "__main__":
    main()
