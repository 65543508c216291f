"""`l2_prefetch`: a Triton device function that asks the GPU's L2 cache to fetch a byte range.

A denoising round runs many short, latency-bound kernels between the reads of the big weights.
The DRAM is idle during them; a kernel that runs before a GEMM can ask L2 to fetch that GEMM's
weight in the meantime (`cp.async.bulk.prefetch.L2.global`, sm_90+: the copy engine fetches the
bytes; the asking thread does not wait, and nothing is written anywhere but L2). It is a hint:
results never depend on it, only the time the next kernel waits for its loads.

The programs of a grid share the range; each program's first thread asks for its share in pieces
of at most `PIECE` bytes (one instruction each). Compiled kernels only: under
Triton's CPU interpreter (no inline PTX) and with `ENABLED` false it does nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["l2_prefetch"]


PIECE = 65536  # bytes per prefetch instruction at most
_PIECE_UNITS = tl.constexpr(PIECE // 16)


@triton.jit
def l2_prefetch(base_ptr, nbytes, program, programs, ENABLED: tl.constexpr):
    """Ask L2 for bytes `[0, nbytes)` from `base_ptr` (16-byte aligned; a tail of under 16
    bytes is left out), as participant `program` of `programs`: its share, in pieces of at most
    `PIECE` bytes, each asked for by the program's first thread."""
    if ENABLED:
        total = (nbytes // 16).to(tl.int64)  # 16-byte units
        share = (total + programs - 1) // programs
        start = program * share
        end = tl.minimum(start + share, total)
        base = base_ptr.to(tl.pointer_type(tl.int8))
        for unit in range(start, end, _PIECE_UNITS):
            size = (tl.minimum(unit + _PIECE_UNITS, end) - unit).to(tl.int32) * 16
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r", [base + unit * 16, size], dtype=tl.int32, is_pure=False, pack=1)
