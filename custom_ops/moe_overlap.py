"""Down programs of `dlmc::nvfp4_moe` that start before the gate/up launch has finished.

Launched with programmatic dependent launch (PDL, sm_90+: `_pdl`), the down launch may start
once every gate/up program has started. Its programs then fill the SMs that gate/up's last
programs leave idle, instead of waiting for the whole launch (`gdc_wait`): each waits only
for the `h` rows it reads. Per slot (a routing block, or a token chunk of the shared expert's parts,
`moe_shared_parts`) the gate/up programs that write its rows count themselves done (`signal`:
all threads' stores, a block barrier, then a release increment, CUTLASS's semaphore pattern);
a down program of that slot spins until the count is complete (`wait`: acquire reads). The last
down reader of a slot zeroes its two counters, so they are zero between launches and the next
layer's launches (which wait for this one) start from zero.

Both launches then order their programs slot by slot (N-tile fastest, `program`), so the first
slots are complete first. Without PDL (and under the CPU interpreter, which runs programs one
after the other) the waits are satisfied on arrival: the same results, bit for bit.

`nvfp4_moe(..., pdl=True)` (the default) launches its gate/up and down kernels with PDL and the
counters on sm_90+ (`overlap_pdl`), and with the counters alone under the CPU interpreter
(tests: `overlap_active`). On sm_90+ its first and last kernels (`moe_align`, `moe_combine`)
launch with PDL too, so that their start-up overlaps the kernel before them. The op is
registered opaque: Inductor cannot launch with PDL, and the counters are a buffer of the op's
own. With `pdl=False` the launches are plain and uncounted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import INTERPRETED, device_has_pdl

__all__ = ["counters", "overlap_active", "overlap_pdl", "program", "signal", "wait"]


def overlap_active(device: torch.device, pdl: bool) -> bool:
    """Whether `nvfp4_moe(..., pdl=pdl)` on `device` uses the per-slot counters: `pdl` on a
    device with PDL, or under the interpreter (see the module docstring)."""
    return pdl and (INTERPRETED or device_has_pdl(device))


def overlap_pdl(device: torch.device, pdl: bool) -> bool:
    """Whether its launches on `device` also use PDL: `pdl` on sm_90+ (not interpreted)."""
    return pdl and device_has_pdl(device)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, slots: int) -> torch.Tensor:
    """int32 `[2 * slots]` or longer, zero: each slot's done count, then its readers' count.
    One buffer per device, kept (the kernels leave it zero); a larger one is made when needed
    (during CUDA graph capture a new one is not kept: its zeroing is part of that graph)."""
    held = _COUNTERS.get(device)
    if held is not None and held.numel() >= 2 * slots:
        return held
    fresh = torch.zeros(max(2 * slots, 4096), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _COUNTERS[device] = fresh
    return fresh


@triton.jit
def program(SHARED: tl.constexpr, OVERLAP: tl.constexpr):
    """(M-block or part row, N-tile) of this program. Without `OVERLAP` the grid is (rows,
    tiles), with it (tiles, rows): a row's tiles start one after the other. With the shared
    expert the rows run in reverse order (`_nvfp4_moe_kernels`)."""
    if OVERLAP:
        pid_m, pid_n, rows = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    else:
        pid_m, pid_n, rows = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    if SHARED:
        pid_m = rows - 1 - pid_m
    return pid_m, pid_n


@triton.jit
def signal(count_ptr, slot):
    """The calling program's rows of `slot` are stored (every thread's stores, then one
    release increment)."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr + slot, 1, sem="release", scope="gpu")


@triton.jit
def wait(count_ptr, num_slots, slot, writers, readers):
    """Spin until `writers` programs have signalled `slot`, then count this reader; the last of
    `readers` zeroes the slot's two counters (all readers are past their spin by then)."""
    while tl.atomic_add(count_ptr + slot, 0, sem="acquire", scope="gpu") < writers:
        pass
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + num_slots + slot, 1, sem="relaxed", scope="gpu") == readers - 1:
        tl.atomic_xchg(count_ptr + slot, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + num_slots + slot, 0, sem="relaxed", scope="gpu")
