"""Static SASS analysis of the `dlmc::nvfp4_moe` kernels, on a machine without a GPU.

Compiles both kernels ahead of time for sm_90 (Triton's bundled ptxas), disassembles them with the
bundled cuobjdump and reports, for each main loop, SASS instructions per weight element per thread
and the opcode mix. The dequantization is ALU-bound (perf/results/nvfp4_moe_h200.md): at H200
bandwidth an SM has room for about 3.5 instructions per weight, so this count is the figure of
merit between GPU runs. Pointer and stride arguments are marked 16-divisible, as Triton's launcher
specializes them at run time.

    python perf/sass_nvfp4_moe.py [--block-n 64 --block-k 128 --num-warps 4 --num-stages 3]
    python perf/sass_nvfp4_moe.py --variants 3 4 --block-n 64 128   # v4 next to v3, both tiles
    python perf/sass_nvfp4_moe.py --variants 3 4 --shared   # with the shared expert's BF16 branch

Also reports each kernel's registers per thread, spills and shared memory, and the main loop's
block-scale instructions (the E4M3 decode: HADD2, FMUL, F2FP; v4 loads them pre-decoded).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import triton
from offline_sass import disassemble
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dlmc.custom_ops import nvfp4_moe as op
from dlmc.custom_ops.moe_shared_parts import shared_block_k, shared_split

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
BACK_BRANCH = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)")
GATE_UP = {"a_ptr": "*bf16", "sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32",
           "gate_w": "*u8", "gate_s": "*u8", "up_w": "*u8", "up_s": "*u8",
           "gate_alpha_ptr": "*fp32", "up_alpha_ptr": "*fp32", "shared_gate_w": "*bf16",
           "shared_up_w": "*bf16", "h_ptr": "*bf16", "num_pairs": "i32", "a_row_div": "i32",
           "shared_id": "i32", "H": "constexpr", "I": "constexpr", "stride_a": "i32",
           "stride_h": "i32", "num_blocks": "i32", "pairs_per_token": "i32", "count_ptr": "*i32"}
DOWN = {"h_ptr": "*bf16", "sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32",
        "down_w": "*u8", "down_s": "*u8", "down_alpha_ptr": "*fp32", "shared_down_w": "*bf16",
        "y_ptr": "*bf16", "num_pairs": "i32", "shared_id": "i32", "H": "constexpr",
        "I": "constexpr", "stride_h": "i32", "stride_y": "i32", "num_blocks": "i32",
        "pairs_per_token": "i32", "count_ptr": "*i32", "num_slots": "i32"}
META = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "INTERPRETED", "VARIANT", "SHARED", "SHARED_BLOCK_K",
        "SHARED_SPLIT", "OVERLAP")
DIVISIBLE = ("num_pairs", "stride_a", "stride_h", "stride_y")
RESOURCE = re.compile(r"\b(REG|STACK|LOCAL):(\d+)")
SCALE_ARGS = ("gate_s", "up_s", "down_s")  # v4, v6: int16 bit patterns of the pre-decoded bf16


def sass(kernel: object, signature: dict[str, str], constants: dict[str, object],
         options: dict[str, int]) -> tuple[str, dict[str, int]]:
    """(SASS text, {registers, local, stack, shared}) of one kernel compiled for sm_90."""
    signature = signature | dict.fromkeys(META, "constexpr")
    if constants["VARIANT"] in (4, 6):
        signature |= {name: "*i16" for name in SCALE_ARGS if name in signature}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*") or name in DIVISIBLE}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    text, usage = disassemble(compiled)
    # REG: registers per thread; LOCAL/STACK: bytes of local memory per thread (spills land
    # there); shared: Triton's dynamic shared memory (the pipeline's buffers) per program.
    fields = {key: int(value) for key, value in RESOURCE.findall(usage)}
    return text, {"registers": fields["REG"], "local": fields["LOCAL"], "stack": fields["STACK"],
                  "shared": compiled.metadata.shared}

def loop_mix(text: str) -> tuple[int, collections.Counter[str]]:
    """Instructions and opcode counts inside the backward-branch loops."""
    lines = text.splitlines()
    loops = []
    for line in lines:
        match = BACK_BRANCH.match(line)
        if match and int(match.group(2), 16) < int(match.group(1), 16):
            loops.append((int(match.group(2), 16), int(match.group(1), 16)))
    mix: collections.Counter[str] = collections.Counter()
    for line in lines:
        match = INSTRUCTION.match(line)
        if match and any(lo <= int(match.group(1), 16) <= hi for lo, hi in loops):
            mix[match.group(2).split(".")[0]] += 1
    return sum(mix.values()), mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--block-n", type=int, nargs="+", default=[64])
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--variants", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's SASS here")
    parser.add_argument("--shared", action="store_true",
                        help="the kernels with the shared expert's BF16 branch (SHARED=True): "
                             "registers/spills/shared memory; the loop counts then include the "
                             "BF16 branch's loops")
    parser.add_argument("--overlap", action="store_true",
                        help="the kernels with moe_overlap's per-slot counters (OVERLAP=True)")
    args = parser.parse_args()
    options = {"num_warps": args.num_warps, "num_stages": args.num_stages}
    threads = 32 * args.num_warps
    print(f"sm_90, Triton {triton.__version__}, H={args.hidden} I={args.inter} "
          f"BLOCK_M={args.block_m} BLOCK_K={args.block_k} num_warps={args.num_warps} "
          f"num_stages={args.num_stages}")
    for block_n, variant in ((n, v) for n in args.block_n for v in args.variants):
        for name, kernel, signature, matrices in (("gate_up", op._gate_up_kernel, GATE_UP, 2),
                                                  ("down", op._down_kernel, DOWN, 1)):
            constants = {"H": args.hidden, "I": args.inter, "BLOCK_M": args.block_m,
                         "BLOCK_N": block_n, "BLOCK_K": args.block_k,
                         "INTERPRETED": False, "VARIANT": variant, "SHARED": args.shared,
                         "SHARED_BLOCK_K": shared_block_k(
                             args.hidden if name == "gate_up" else args.inter, name),
                         "SHARED_SPLIT": shared_split(block_n), "OVERLAP": args.overlap}
            if name == "down":  # the gate/up launch's tiles (same BLOCK_N) for the waits
                constants |= {"GATE_UP_TILES": -(-args.inter // block_n),
                              "GATE_UP_SPLIT": shared_split(block_n)}
                signature = signature | dict.fromkeys(("GATE_UP_TILES", "GATE_UP_SPLIT"),
                                                      "constexpr")
            text, resources = sass(kernel, signature, constants, options)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"v{variant}_{name}_bn{block_n}.sass").write_text(text)
            count, mix = loop_mix(text)
            # v1 has one loop per matrix, v2-v4 one loop over both: either way the loops together
            # cover one K-step of every matrix.
            weights = matrices * block_n * args.block_k / threads
            scale_decode = sum(mix[k] for k in ("HADD2", "FMUL", "F2FP"))
            top = ", ".join(f"{k} {v / weights:.2f}" for k, v in mix.most_common(8))
            label = (f"v{variant}{'+shared' if args.shared else ''}"
                     f"{'+overlap' if args.overlap else ''}")
            print(f"{label} {name:8s} BLOCK_N {block_n:3d}: loop instructions per weight per "
                  f"thread {count / weights:5.2f}; HADD2+FMUL+F2FP {scale_decode / weights:4.2f}; "
                  f"registers {resources['registers']}, spills (local/stack bytes) "
                  f"{resources['local']}/{resources['stack']}, shared {resources['shared']} B"
                  f"   ({top})")

if __name__ == "__main__":
    main()
