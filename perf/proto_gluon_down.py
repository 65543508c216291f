"""Prototype: the NVFP4 down projection as a persistent, warp-specialized Gluon kernel.

`perf/probe_ws_stream.py` (session 24) showed that the op's bytes stream at ~92 % of copy even
from plain loads: the op's kernels are held back by their programs (short K loops that refill a
3-stage pipeline per program at 3 programs per SM), not by loading. The down kernel is the
weaker one (K = 512: four K-steps per program, about 65 % of copy). Here one producer warp per
program issues TMA copies of each work item's weight chunk (8 KB of v7 words), block-scale codes
(1 KB) and the block's h rows (two 2 KB halves) into a `STAGES`-deep ring, running ahead across
work items; the consumer warps decode the words with v7's asm into `mma_v2` B operands and
accumulate. Work items are (routing block, N-tile) pairs, taken by the persistent programs in
turn.

h layout: each 128-column K-step of h is stored even columns first, then odd
(`even_odd_columns`), so the two halves are the A operands of the low- and high-nibble MMAs
(v7 splits A in registers). The gate/up kernel would store h this way (a store-address change).

The `swap` configurations (`--configs ...,1`) run the op's kernel, `custom_ops/
_nvfp4_down_gluon.py` (weights as the MMA's A operand, 8-slot parts of the 16-slot blocks);
session 24's calls 2-10 ran this script's own earlier copy of it (commit 0ea5181, 8-slot
routing blocks then), with the same timings' code.

    python3 perf/proto_gluon_down.py --compile-only            # CPU: lower for sm_90
    python3 perf/proto_gluon_down.py --out perf/results/s24/proto_gluon_down.json   # H200
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import triton
from offline_sass import disassemble, print_rows, replay_times, require_mbarrier_ring, run
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from dlmc.custom_ops import _nvfp4_down_gluon as swapped
from dlmc.custom_ops._nvfp4_gluon_parts import _decoded_tiles, ring_barriers, shared_layouts
from dlmc.custom_ops.nvfp4_scale_codes import PAIR_ADD, PAIR_MUL
from dlmc.custom_ops.nvfp4_words import DECODE_WORDS_ASM

H, I, BM, BN, BK = 2048, 512, 16, 128, 128
KSTEPS = I // BK
TILES = H // BN
ACC_SCALE = 128.0
_ASM = gl.constexpr(DECODE_WORDS_ASM.value)
_PMUL, _PADD = gl.constexpr(PAIR_MUL), gl.constexpr(PAIR_ADD)


@gluon.jit
def _item(expert_of_block_ptr, item, num_items, TILES: gl.constexpr):
    """(routing block, N-tile) of a work item, and the expert of the program's next item, asked
    for now so that its latency hides behind this item's work."""
    nxt = item + gl.num_programs(0)
    next_expert = gl.load(expert_of_block_ptr + nxt // TILES, mask=nxt < num_items, other=-1)
    return item // TILES, item % TILES, next_expert


@gluon.jit
def _producer(w_d, s_d, a_d, expert_of_block_ptr, num_items, empty, ready, w_buf, s_buf,
              a_buf, STAGES: gl.constexpr, KSTEPS: gl.constexpr, TILES: gl.constexpr,
              I: gl.constexpr, H: gl.constexpr, BM: gl.constexpr):
    i = 0  # K-steps copied so far (the ring position)
    expert = gl.load(expert_of_block_ptr + gl.program_id(0) // TILES)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        block, tile, next_expert = _item(expert_of_block_ptr, item, num_items, TILES)
        if expert >= 0:
            row0 = expert * H + tile * 128  # first weight row of the item
            for k in gl.static_range(KSTEPS):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, w_d.block_type.nbytes + s_d.block_type.nbytes
                                + 2 * a_d.block_type.nbytes)
                # v7 words: the item's chunk k at word row0 * I/8 + k * 128 * 16 (32 words a
                # descriptor row); codes at byte row0 * I/16 + k * 128 * 8 (128 bytes a row)
                tma.async_copy_global_to_shared(w_d, [row0 * (I // 256) + k * 64, 0], bar,
                                                w_buf.index(s))
                tma.async_copy_global_to_shared(s_d, [row0 // 4 + k * 8, 0], bar,
                                                s_buf.index(s))
                tma.async_copy_global_to_shared(a_d, [block * BM, k * 128], bar,
                                                a_buf.index(2 * s))
                tma.async_copy_global_to_shared(a_d, [block * BM, k * 128 + 64], bar,
                                                a_buf.index(2 * s + 1))
                i += 1
        expert = next_expert


@gluon.jit
def _consumer(sorted_pair_ptr, expert_of_block_ptr, alpha_ptr, y_ptr, num_items, num_pairs,
              stride_y, empty, ready, w_buf, s_buf, a_buf, STAGES: gl.constexpr,
              KSTEPS: gl.constexpr, TILES: gl.constexpr, NUM_WARPS: gl.constexpr,
              SWIZZLED: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    # words as bytes [n 128, block 8, half 2, byte 4]: lane bit 0 -> half, bit 1 -> block,
    # bits 2-4 -> n; warps -> n (8 rows each); a thread's 4 bytes are one word.
    w4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [8, 2, 2, 1], [NUM_WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])
    c2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, w4))  # codes [n 128, block 8]
    plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    w_bytes: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                 rank=2)
    # w4's elements as the chunk's [64, 128] bytes (row r = weight rows 2r, 2r+1): registers
    # -> byte, block bits 1-2, n bits 5-6; lanes -> half, block bit 0, n bits 0-2; warps -> n
    # bits 3-4 (n = 2r + c // 64)
    wl2: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [16, 0], [32, 0]],
        lane_bases=[[0, 4], [0, 8], [0, 64], [1, 0], [2, 0]],
        warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[64, 128])
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    i = 0  # K-steps consumed so far
    expert = gl.load(expert_of_block_ptr + gl.program_id(0) // TILES)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        block, tile, next_expert = _item(expert_of_block_ptr, item, num_items, TILES)
        if expert >= 0:
            # the epilogue's loads are issued before the K loop too (its latency hides there)
            alpha = gl.load(alpha_ptr + expert) * 128.0
            slots = block * 16 + gl.arange(0, 16, rows_l)
            pairs = gl.load(sorted_pair_ptr + slots)
            acc = gl.zeros([16, 128], gl.float32, mma)
            for _ in gl.static_range(KSTEPS):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if SWIZZLED:  # 128-byte swizzled chunk rows (two weight rows each) as bytes
                    words = w_buf.index(s)._reinterpret(gl.uint8, [64, 128], w_bytes).load(wl2)
                    words = gl.convert_layout(gl.reshape(words, [128, 8, 2, 4]), w4)
                else:
                    words = w_buf.index(s)._reinterpret(gl.uint8, [128, 8, 2, 4], plain4).load(w4)
                codes = s_buf.index(s)._reinterpret(gl.uint8, [128, 8], plain2).load(c2)
                a_even = a_buf.index(2 * s).load(a_layout)
                a_odd = a_buf.index(2 * s + 1).load(a_layout)
                fence_async_shared()
                mbarrier.arrive(empty.index(s), count=1)
                lo, hi = _decoded_tiles(words, codes)
                lo = gl.convert_layout(gl.permute(lo, [1, 0]), b_layout)
                hi = gl.convert_layout(gl.permute(hi, [1, 0]), b_layout)
                acc = mma_v2(a_even, lo, acc)
                acc = mma_v2(a_odd, hi, acc)
                i += 1
            cols = tile * 128 + gl.arange(0, 128, cols_l)
            ptrs = (y_ptr + gl.expand_dims(pairs.to(gl.int64) * stride_y, 1)
                    + gl.expand_dims(cols, 0))
            mask = gl.expand_dims(pairs < num_pairs, 1) & gl.expand_dims(cols >= 0, 0)
            gl.store(ptrs, (acc * alpha).to(gl.bfloat16), mask=mask)
        expert = next_expert


@gluon.jit
def down_gluon(w_d, s_d, a_d, sorted_pair_ptr, expert_of_block_ptr, alpha_ptr, y_ptr,
               num_items, num_pairs, stride_y, STAGES: gl.constexpr, KSTEPS: gl.constexpr,
               TILES: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, SWIZZLED: gl.constexpr):
    w_buf = gl.allocate_shared_memory(w_d.dtype, [STAGES] + w_d.block_type.shape, w_d.layout)
    s_buf = gl.allocate_shared_memory(s_d.dtype, [STAGES] + s_d.block_type.shape, s_d.layout)
    a_buf = gl.allocate_shared_memory(a_d.dtype, [2 * STAGES] + a_d.block_type.shape,
                                      a_d.layout)
    empty, ready = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (sorted_pair_ptr, expert_of_block_ptr, alpha_ptr, y_ptr, num_items,
                     num_pairs, stride_y, empty, ready, w_buf, s_buf, a_buf, STAGES, KSTEPS,
                     TILES, gl.num_warps(), SWIZZLED)),
        (_producer, (w_d, s_d, a_d, expert_of_block_ptr, num_items, empty, ready, w_buf,
                     s_buf, a_buf, STAGES, KSTEPS, TILES, I, H, 16))], [1], [PRODUCER_REGS])


def layouts(swizzled: bool):
    """Shared layouts of the three TMA boxes: weights (one 8 KB chunk) as uint8 [64, 128] with
    128-byte swizzle (`swizzled`) or int32 [64, 32] unswizzled, codes int32 [8, 32] (1 KB)
    unswizzled, h bf16 [16, 64] (128-byte swizzle)."""
    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    return (w if swizzled else plain), plain, a


def weight_box(swizzled: bool) -> tuple[str, list[int]]:
    return ("u8", [64, 128]) if swizzled else ("i32", [64, 32])


def even_odd_columns(h):
    """h [S, I] -> each 128-column K-step's even columns, then its odd ones (the A halves)."""
    S, n = h.shape
    return h.reshape(S, n // 128, 64, 2).transpose(2, 3).reshape(S, n)


def compile_only(args: argparse.Namespace) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    scalars = {"num_items": "i32", "num_pairs": "i32"}
    consts = {"STAGES": args.stages, "KSTEPS": KSTEPS, "TILES": TILES, "I": I, "H": H}
    if args.swap:  # the op's kernel (`custom_ops/_nvfp4_down_gluon.py`)
        w, s, a = shared_layouts()
        kernel = swapped._down_gluon_kernel
        sig = {"w_d": f"tensordesc<u8[64, 128],{w!r}>", "s_d": f"tensordesc<i32[8, 32],{s!r}>",
               "h_d": f"tensordesc<bf16[8, 64],{a!r}>", "expert_of_block_ptr": "*i32",
               "sorted_pair_ptr": "*i32", "alpha_ptr": "*fp32", "y_ptr": "*bf16"} | scalars | {
               "shared_id": "i32", "stride_y": "i32", "h_ptr": "*bf16", "stride_h": "i32",
               "count_ptr": "*i32", "num_slots": "i32", "writers": "i32"}
        consts |= {"BLOCK_M": BM}
    else:
        w, s, a = layouts(args.swizzled)
        kind, box = weight_box(args.swizzled)
        kernel = down_gluon
        sig = {"w_d": f"tensordesc<{kind}[{box[0]}, {box[1]}],{w!r}>",
               "s_d": f"tensordesc<i32[8, 32],{s!r}>", "a_d": f"tensordesc<bf16[16, 64],{a!r}>",
               "sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32", "alpha_ptr": "*fp32",
               "y_ptr": "*bf16"} | scalars | {"stride_y": "i32"}
        consts |= {"PRODUCER_REGS": args.producer_regs, "SWIZZLED": args.swizzled}
    sig |= dict.fromkeys(consts, "constexpr")
    compiled = triton.compile(GluonASTSource(kernel, sig, consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": args.num_warps, "maxnreg": args.maxnreg})
    sass, usage = disassemble(compiled)
    if args.dump:
        Path(args.dump).write_text(sass + "\n\n" + compiled.asm["ttgir"])
    ops = {op: sass.count(op) for op in ("HMMA", "LDS", "STS", "SHFL", "PRMT", "LOP3", "HMUL2",
                                         "UTMALDG", "SYNCS", "BAR", "STL", "LDL")}
    return {"shared": compiled.metadata.shared, "usage": usage.strip().splitlines()[-1].strip(),
            "ops": ops}


def run_gpu(args: argparse.Namespace) -> dict:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dlmc.bench.timing import copy_bandwidth_gbps, cuda_times
    from dlmc.custom_ops._nvfp4_moe_kernels import _down_kernel
    from dlmc.custom_ops.moe_align import route_pairs

    E, L, T, K = 256, 19, 32, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = []
    for _ in range(L):
        words = torch.randint(-2**31, 2**31 - 1, (E, H, I // 8), device="cuda",
                              dtype=torch.int32, generator=gen)
        codes = torch.randint(0, 144, (E, H, I // 16), device="cuda", dtype=torch.int32,
                              generator=gen).to(torch.int8)
        alpha = torch.rand(E, device="cuda", generator=gen) * 1e-2
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]
        block_m, sorted_pair, expert_of_block = route_pairs(ids.to(torch.int32), E)
        assert block_m == BM, block_m
        S = expert_of_block.shape[0] * BM
        h = (torch.randn(S, I, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        h_eo = even_odd_columns(h).contiguous()
        descs = {}  # (swizzled, swap): the weights', codes' and h's descriptors
        for swizzled, swap in ((False, False), (True, False), (True, True)):
            w_l, s_l, a_l = shared_layouts() if swap else layouts(swizzled)
            w_view = (words.view(torch.uint8).view(-1, 128) if swizzled
                      else words.view(-1, 32))
            descs[swizzled, swap] = (
                TensorDescriptor.from_tensor(w_view, weight_box(swizzled)[1], w_l),
                TensorDescriptor.from_tensor(codes.view(torch.int32).view(-1, 32), [8, 32], s_l),
                TensorDescriptor.from_tensor(h_eo, [8 if swap else 16, 64], a_l))
        y_ref = torch.zeros(T * K, H, dtype=torch.bfloat16, device="cuda")
        y_new = torch.zeros_like(y_ref)
        layers.append(dict(words=words, codes=codes, alpha=alpha, sorted_pair=sorted_pair,
                           expert_of_block=expert_of_block, h=h, descs=descs, y_ref=y_ref,
                           y_new=y_new, touched=int((expert_of_block >= 0).sum()), h_eo=h_eo))

    def v7() -> None:
        for lay in layers:
            nb = lay["expert_of_block"].shape[0]
            _down_kernel[(nb, TILES)](
                lay["h"], lay["sorted_pair"], lay["expert_of_block"],
                lay["words"].view(torch.uint8),
                lay["codes"].view(torch.uint8), lay["alpha"], lay["y_ref"], T * K, H, I,
                lay["h"].stride(0), lay["y_ref"].stride(0), lay["h"], E, nb, K,
                lay["expert_of_block"], nb, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                INTERPRETED=False, VARIANT=7, SHARED=False, SHARED_BLOCK_K=128, SHARED_SPLIT=1,
                num_warps=4, num_stages=3)

    def gluon_run(stages: int, per_sm: int, warps: int, maxnreg: int, swizzled: int,
                  swap: int) -> None:
        for lay in layers:
            blocks, grid = lay["expert_of_block"].shape[0], (num_sms * per_sm,)
            if swap:  # the op's kernel: 8-slot parts of the 16-slot blocks (4 warps)
                swapped._down_gluon_kernel[grid](
                    *lay["descs"][True, True], lay["expert_of_block"], lay["sorted_pair"],
                    lay["alpha"], lay["y_new"], blocks * 2 * TILES, T * K, E,
                    lay["y_new"].stride(0), lay["h_eo"], lay["h_eo"].stride(0),
                    lay["expert_of_block"], 0, 0, STAGES=stages, KSTEPS=KSTEPS, TILES=TILES, I=I,
                    H=H, BLOCK_M=BM, num_warps=4, maxnreg=maxnreg)
                continue
            down_gluon[grid](
                *lay["descs"][bool(swizzled), False], lay["sorted_pair"],
                lay["expert_of_block"], lay["alpha"], lay["y_new"], blocks * TILES, T * K,
                lay["y_new"].stride(0), STAGES=stages, KSTEPS=KSTEPS, TILES=TILES, I=I, H=H,
                PRODUCER_REGS=args.producer_regs, SWIZZLED=bool(swizzled), num_warps=warps,
                maxnreg=maxnreg)

    blocks_touched = sum(lay["touched"] for lay in layers)
    nbytes = blocks_touched * TILES * (BN * I // 2 + BN * I // 16)  # weight + code bytes read
    experts = sum(int(torch.unique(lay["expert_of_block"][lay["expert_of_block"] >= 0]).numel())
                  for lay in layers)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "argv": sys.argv, "layers": L,
              "experts_touched_per_layer": experts / L, "blocks_touched_per_layer":
              blocks_touched / L,
              "copy_GBps": copy_bandwidth_gbps(1 << 30, 30), "rows": []}

    def configs(report: dict, repeat: int) -> None:
        for stages, per_sm, warps, maxnreg, swizzled, swap in args.configs:
            row = {"kernel": "gluon down", "stages": stages, "ctas_per_sm": per_sm, "warps": warps,
                   "maxnreg": maxnreg, "swizzled": swizzled, "swap": swap, "repeat": repeat}
            try:
                for lay in layers:
                    lay["y_new"].zero_()
                gluon_run(stages, per_sm, warps, maxnreg, swizzled, swap)
                torch.cuda.synchronize()
                diffs = [(lay["y_new"].float() - lay["y_ref"].float()).abs().max().item()
                         for lay in layers]
                scale = max(lay["y_ref"].float().abs().max().item() for lay in layers)
                equal = all(torch.equal(lay["y_new"], lay["y_ref"]) for lay in layers)
                times = timed(lambda s=stages, p=per_sm, w=warps, m=maxnreg, z=swizzled,
                              a=swap: gluon_run(s, p, w, m, z, a))
                ms = statistics.median(times)
                row |= {"us_per_layer": ms * 1e3 / L, "min_max_us_per_layer":
                        [min(times) * 1e3 / L, max(times) * 1e3 / L],
                        "GBps": nbytes / (ms * 1e-3) / 1e9,
                        "max_abs_diff_vs_v7": max(diffs), "max_abs_v7": scale,
                        "bit_equal_to_v7": equal}
            except Exception as error:  # a config that does not compile or launch
                row["error"] = repr(error)[:400]
            report["rows"].append(row)

    def timed(run) -> list[float]:
        """ms per call of `run` (all layers): replays of a CUDA graph of it (device time: the
        Gluon launches' host time, TMA descriptors included, can exceed the kernels' and made
        session 24's first host-launched timings bimodal), or host launches (`--no-graph`)."""
        if args.no_graph:
            return cuda_times(run, args.iters, warmup=3)
        return replay_times(run, args.iters)

    v7()
    torch.cuda.synchronize()
    report["timing"] = "host launches" if args.no_graph else "CUDA graph replays"
    for repeat in range(args.repeats):
        times = timed(v7)
        ms = statistics.median(times)
        report["rows"].append({"kernel": "v7 down (Triton)", "repeat": repeat,
                               "us_per_layer": ms * 1e3 / L, "min_max_us_per_layer":
                               [min(times) * 1e3 / L, max(times) * 1e3 / L],
                               "GBps": nbytes / (ms * 1e-3) / 1e9})
        configs(report, repeat)
    return print_rows(report, nbytes / L)


def _config(text: str) -> tuple[int, ...]:
    values = [int(v) for v in text.split(",")]
    return tuple(values + [1, 0][len(values) - 4:])  # swizzled, not swapped unless said


def main() -> None:
    require_mbarrier_ring("proto_gluon_down.py")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--maxnreg", type=int, default=128)
    parser.add_argument("--producer-regs", type=int, default=40)
    parser.add_argument("--swizzled", type=int, default=1)
    parser.add_argument("--swap", type=int, default=0, help="--compile-only: the op's kernel "
                        "(weights as the MMA's A operand, 8-slot parts of the blocks)")
    parser.add_argument("--dump", type=Path, help="--compile-only: write SASS + TTGIR here")
    parser.add_argument("--configs", type=_config, nargs="+",
                        default=[(4, 4, 4, 64, 1, 0), (4, 4, 4, 64, 1, 1)],
                        help="stages,ctas_per_sm,num_warps,maxnreg[,swizzled (1)[,swap (0)]]")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1, help="v7 and the configs, in turn")
    parser.add_argument("--no-graph", action="store_true",
                        help="time host launches instead of CUDA graph replays")
    run(parser, compile_only, run_gpu)


if __name__ == "__main__":
    main()
