"""Probe: how fast can the NVFP4 gate/up bytes stream with a warp-specialized Gluon kernel?

The `dlmc::nvfp4_moe` gate/up kernel (Triton, one program per (expert, 128-row N-tile), a
3-stage cp.async pipeline, 1.65 waves) reaches about 75 % of the copy bandwidth. This probe
reads exactly those bytes (the touched experts' gate and up chunks and block scales of v7's
128-row layout, 288 KB per tile, 19 layers' weights in turn) with two kernels that do no
decode, only `WORK` integer multiply-adds per 32-bit word (the v7 decode is about 20
instructions per word):

- `triton`: the op's structure, one program per tile, `tl.load` of each 8 KB chunk;
- `gluon`: persistent programs (`--ctas-per-sm` per SM), one producer warp issuing TMA copies
  of each K-step's four chunks into an `--stages`-deep shared-memory ring guarded by mbarriers,
  four consumer warps reading the ring.

If the Gluon kernel streams at >= 90 % of copy with the decode's work per word while the
Triton one does not, a warp-specialized op is the way to the 80 % target.

    python3 perf/probe_ws_stream.py --out perf/results/s24/probe_ws_stream.json
    python3 perf/probe_ws_stream.py --compile-only   # CPU: lower both for sm_90, print resources
"""

from __future__ import annotations

import argparse
import statistics
import sys

import triton
import triton.language as tl
from offline_sass import disassemble, print_rows, replay_times, require_mbarrier_ring, run
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from dlmc.custom_ops._nvfp4_gluon_parts import chunk_rings, ring_barriers

KSTEPS = 16  # K 2048 / 128
CHUNK_ROWS, WORDS = 64, 32  # one 8 KB weight chunk as int32 [64, 32]
SCALE_ROWS = 8  # one 1 KB scale chunk as int32 [8, 32]
TILE_BYTES = KSTEPS * 2 * (8192 + 1024)


@gluon.jit
def _mix(acc, words, WORK: gl.constexpr):
    acc = acc ^ words
    for _ in gl.static_range(WORK):
        acc = acc * 0x3779B1 + words
    return acc


@gluon.jit
def _producer(gate_d, up_d, gs_d, us_d, tiles_ptr, num_tiles, empty, ready, g_buf, u_buf,
              gs_buf, us_buf, STAGES: gl.constexpr, KSTEPS: gl.constexpr):
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        base = gl.load(tiles_ptr + t)  # first chunk of the tile
        for k in range(KSTEPS):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, 2 * gate_d.block_type.nbytes + 2 * gs_d.block_type.nbytes)
            tma.async_copy_global_to_shared(gate_d, [(base + k) * 64, 0], bar, g_buf.index(s))
            tma.async_copy_global_to_shared(up_d, [(base + k) * 64, 0], bar, u_buf.index(s))
            tma.async_copy_global_to_shared(gs_d, [(base + k) * 8, 0], bar, gs_buf.index(s))
            tma.async_copy_global_to_shared(us_d, [(base + k) * 8, 0], bar, us_buf.index(s))
            i += 1


@gluon.jit
def _consumer(out_ptr, num_tiles, empty, ready, g_buf, u_buf, gs_buf, us_buf,
              STAGES: gl.constexpr, KSTEPS: gl.constexpr, WORK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    slayout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros([64, 32], gl.int32, layout)
        sacc = gl.zeros([8, 32], gl.int32, slayout)
        for _ in range(KSTEPS):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            g = g_buf.index(s).load(layout)
            u = u_buf.index(s).load(layout)
            gs = gs_buf.index(s).load(slayout)
            us = us_buf.index(s).load(slayout)
            fence_async_shared()
            mbarrier.arrive(empty.index(s), count=1)
            acc = _mix(_mix(acc, g, WORK), u, WORK)
            sacc = sacc ^ gs ^ us
            i += 1
        total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(sacc, axis=1), axis=0)
        gl.store(out_ptr + t, total)


@gluon.jit
def stream_gluon(gate_d, up_d, gs_d, us_d, tiles_ptr, out_ptr, num_tiles,
                 STAGES: gl.constexpr, KSTEPS: gl.constexpr, WORK: gl.constexpr):
    g_buf, u_buf, gs_buf, us_buf = chunk_rings(gate_d, up_d, gs_d, us_d, STAGES)
    empty, ready = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (out_ptr, num_tiles, empty, ready, g_buf, u_buf, gs_buf, us_buf, STAGES,
                     KSTEPS, WORK)),
        (_producer, (gate_d, up_d, gs_d, us_d, tiles_ptr, num_tiles, empty, ready, g_buf,
                     u_buf, gs_buf, us_buf, STAGES, KSTEPS)),
    ], [1], [24])


@triton.jit
def _mix_tl(acc, words, WORK: tl.constexpr):
    acc = acc ^ words
    for _ in tl.static_range(WORK):
        acc = acc * 0x3779B1 + words
    return acc


@triton.jit
def stream_triton(gate_ptr, up_ptr, gs_ptr, us_ptr, tiles_ptr, out_ptr,
                  KSTEPS: tl.constexpr, WORK: tl.constexpr):
    t = tl.program_id(0)
    base = tl.load(tiles_ptr + t)
    r = tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :]
    sr = tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :]
    acc = tl.zeros([64, 32], tl.int32)
    sacc = tl.zeros([8, 32], tl.int32)
    for k in range(KSTEPS):
        off = (base + k).to(tl.int64) * 2048
        soff = (base + k).to(tl.int64) * 256
        acc = _mix_tl(acc, tl.load(gate_ptr + off + r), WORK)
        acc = _mix_tl(acc, tl.load(up_ptr + off + r), WORK)
        sacc = sacc ^ tl.load(gs_ptr + soff + sr) ^ tl.load(us_ptr + soff + sr)
    tl.store(out_ptr + t, tl.sum(acc) + tl.sum(sacc))


def _layouts():
    w = gl.NVMMASharedLayout.get_default_for([CHUNK_ROWS, WORDS], gl.int32)
    s = gl.NVMMASharedLayout.get_default_for([SCALE_ROWS, WORDS], gl.int32)
    return w, s


def compile_only(args: argparse.Namespace) -> dict:
    """Lower both kernels for sm_90 on this machine and report registers / shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    w, s = _layouts()
    wd = f"tensordesc<i32[{CHUNK_ROWS}, {WORDS}],{w!r}>"
    sd = f"tensordesc<i32[{SCALE_ROWS}, {WORDS}],{s!r}>"
    results = {}
    sig = {"gate_d": wd, "up_d": wd, "gs_d": sd, "us_d": sd, "tiles_ptr": "*i32",
           "out_ptr": "*i32", "num_tiles": "i32", "STAGES": "constexpr", "KSTEPS": "constexpr",
           "WORK": "constexpr"}
    consts = {"STAGES": args.stages, "KSTEPS": KSTEPS, "WORK": args.work}
    g = triton.compile(GluonASTSource(stream_gluon, sig, consts), target=target,
                       options={"num_warps": 4, "maxnreg": args.maxnreg})
    tsig = {"gate_ptr": "*i32", "up_ptr": "*i32", "gs_ptr": "*i32", "us_ptr": "*i32",
            "tiles_ptr": "*i32", "out_ptr": "*i32", "KSTEPS": "constexpr", "WORK": "constexpr"}
    tt = triton.compile(ASTSource(stream_triton, tsig, {"KSTEPS": KSTEPS, "WORK": args.work}),
                        target=target, options={"num_warps": 4, "num_stages": 3})
    for name, compiled in (("gluon", g), ("triton", tt)):
        sass, usage = disassemble(compiled)
        results[name] = {"shared": compiled.metadata.shared,
                         "usage": usage.strip().splitlines()[-1].strip(),
                         "tma_loads": sass.count("UTMALDG"), "ldgsts": sass.count("LDGSTS")}
    return results


def run_gpu(args: argparse.Namespace) -> dict:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dlmc.bench.timing import copy_bandwidth_gbps

    E, L, T, K = 256, 19, 32, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = E * 4 * KSTEPS  # per matrix and layer
    layers = []
    for _ in range(L):
        mats = [torch.randint(-2**31, 2**31 - 1, (chunks * CHUNK_ROWS, WORDS), device="cuda",
                              dtype=torch.int32, generator=gen) for _ in range(2)]
        scales = [torch.randint(-2**31, 2**31 - 1, (chunks * SCALE_ROWS, WORDS), device="cuda",
                                dtype=torch.int32, generator=gen) for _ in range(2)]
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]
        experts = torch.unique(ids)
        tiles = ((experts[:, None] * 4 + torch.arange(4, device="cuda")) * KSTEPS).flatten()
        layers.append((mats, scales, tiles.to(torch.int32).contiguous()))
    w, s = _layouts()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "argv": sys.argv, "layers": L,
              "copy_GBps": copy_bandwidth_gbps(1 << 30, 30), "rows": []}
    outs = [torch.empty(len(t), dtype=torch.int32, device="cuda") for _, _, t in layers]
    descs = []
    for mats, scales, _ in layers:
        descs.append([TensorDescriptor.from_tensor(m, [CHUNK_ROWS, WORDS], w) for m in mats]
                     + [TensorDescriptor.from_tensor(m, [SCALE_ROWS, WORDS], s) for m in scales])
    nbytes = sum(len(t) for _, _, t in layers) * TILE_BYTES

    def timed(run) -> float:  # device time: graph replays (Gluon launches are host-heavy)
        return statistics.median(replay_times(run, args.iters))

    for work in args.works:
        def tri(work=work) -> None:
            for (mats, scales, tiles), out in zip(layers, outs, strict=True):
                stream_triton[(len(tiles),)](mats[0], mats[1], scales[0], scales[1], tiles, out,
                                            KSTEPS=KSTEPS, WORK=work, num_warps=4, num_stages=3)
        ms = timed(tri)
        reference = [o.clone() for o in outs]
        report["rows"].append({"kernel": "triton", "work": work, "us_per_layer": ms * 1e3 / L,
                               "GBps": nbytes / (ms * 1e-3) / 1e9})
        for stages in args.stages_list:
            for per_sm in args.ctas_per_sm:
                if stages * 18432 * per_sm > 220 * 1024:
                    continue
                grid = (num_sms * per_sm,)

                def glu(work=work, stages=stages, grid=grid) -> None:
                    for (_, _, tiles), d, out in zip(layers, descs, outs, strict=True):
                        stream_gluon[grid](d[0], d[1], d[2], d[3], tiles, out, len(tiles),
                                           STAGES=stages, KSTEPS=KSTEPS, WORK=work,
                                           num_warps=4, maxnreg=args.maxnreg)
                try:
                    ms = timed(glu)
                except Exception as error:  # a config that does not compile or launch
                    report["rows"].append({"kernel": "gluon", "work": work, "stages": stages,
                                           "ctas_per_sm": per_sm, "error": repr(error)[:300]})
                    continue
                same = all(torch.equal(a, b) for a, b in zip(outs, reference, strict=True))
                report["rows"].append({"kernel": "gluon", "work": work, "stages": stages,
                                       "ctas_per_sm": per_sm, "us_per_layer": ms * 1e3 / L,
                                       "GBps": nbytes / (ms * 1e-3) / 1e9, "equal_to_triton": same})
    return print_rows(report, nbytes / L)


def main() -> None:
    require_mbarrier_ring("probe_ws_stream.py")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--work", type=int, default=0)
    parser.add_argument("--works", type=int, nargs="+", default=[0, 4, 8])
    parser.add_argument("--stages-list", type=int, nargs="+", default=[4, 6, 11])
    parser.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--maxnreg", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    run(parser, compile_only, run_gpu)


if __name__ == "__main__":
    main()
