"""Programmatic dependent launch (PDL) of dlmc's Triton kernels, opt-in with `DLMC_PDL=1`.

With PDL (sm_90+), a kernel may start while the kernel before it in the stream is finishing:
its programs are scheduled as the previous kernel's programs leave, and wait at `gdc_wait` until
that kernel has completed and its writes are visible. Inside a CUDA graph this hides most of
each launch's start-up behind the previous kernel's tail (`perf/probe_pdl.py`).

Rules of the kernels that take a `PDL` constexpr: `pdl_enter(PDL)` is their first statement, so
nothing is read or written before the previous kernel is complete; it then lets the next
kernel launch. Kernels without the parameter launch as usual.

Inductor cannot launch a traced kernel with the PDL attribute, so with `DLMC_PDL=1` the ops of
`_registration.traced_triton_op` are registered as opaque custom ops (as under the CPU
interpreter) and `launcher` launches their kernels itself. Inductor's own kernels are another
switch (`TORCHINDUCTOR_ENABLE_PDL=1`, torch's).

Measured on the H200 (perf/README.md, session 18): a chain of trivial kernels in a graph, 1.04
-> 0.79 µs per kernel; the NVFP4 + FP8 round, 3.070 -> 3.056 ms queued (the kernels of a round
take 2-60 µs, so a launch gap of about 0.25 µs is little of them); the op alone 98.3 -> 96.6
µs per layer (session 19). Off by default; its GPU test (opaque without vs with PDL, one shared
Inductor cache) passed on the H200 in session 19.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from dlmc.errors import ConfigError

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (re-exported by `_registration`)


def pdl_mode() -> str:
    """`DLMC_PDL`: "0" (default), "1", or "opaque" (the ops registered and launched as with
    "1", without the PDL attribute: isolates PDL from the opaque registration). "0" under the
    CPU interpreter."""
    flag = os.environ.get("DLMC_PDL", "0")
    if flag not in ("0", "1", "opaque"):
        raise ConfigError(f"DLMC_PDL={flag!r}: expected 0, 1 or opaque")
    return "0" if INTERPRETED else flag


MODE = pdl_mode()
PDL = MODE == "1"
OPAQUE = MODE != "0"  # the ops are registered opaque and launch their kernels themselves


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def device_has_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: a CUDA device of sm_90+ (not under the
    CPU interpreter)."""
    return not INTERPRETED and device.type == "cuda" and _device_has_pdl(
        device.index if device.index is not None else torch.cuda.current_device())


def pdl_active(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: `DLMC_PDL=1` and a CUDA device of sm_90+."""
    return PDL and device_has_pdl(device)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the previous kernel, then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _defaults(fn: Any) -> tuple[tuple[int, str, Any], ...]:
    """(position, name, default) of each parameter of `fn` that has a default."""
    return tuple((i, name, p.default) for i, (name, p)
                 in enumerate(inspect.signature(fn).parameters.items())
                 if p.default is not inspect.Parameter.empty)


def with_defaults(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` plus the default of every parameter of `kernel` that neither `args` nor `kwargs`
    gives: Inductor's trace of a launch (`wrap_triton`) does not apply a kernel's defaults and
    fails on a missing constexpr (session 19)."""
    return {name: default for i, name, default in _defaults(kernel.fn)
            if i >= len(args) and name not in kwargs} | kwargs


# The launch options with which an opaque op's body launches a kernel that takes a `PDL`
# constexpr with programmatic dependent launch (`launcher` passes them through as given).
PDL_LAUNCH = {"PDL": True, "launch_pdl": True}

# Set while an opaque op's body runs (`_registration.traced_triton_op`): its kernels launch
# directly. `wrap_triton` outside a traced `triton_op` goes through the higher-order op's eager
# path, which cost about 90 µs of host time per launch on the H200 (perf/probe_op_overhead.py,
# session 20: 927 against 284 µs per `nvfp4_moe` call, traced registration).
_DIRECT = contextvars.ContextVar("dlmc_direct_launches", default=False)


@contextlib.contextmanager
def direct_launches() -> Iterator[None]:
    """Within this block every `launcher` launches its kernel directly (an opaque op's body)."""
    token = _DIRECT.set(True)
    try:
        yield
    finally:
        _DIRECT.reset(token)


class _Launcher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.takes_pdl = "PDL" in getattr(kernel, "arg_names", ())

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            if self.takes_pdl and "PDL" not in kwargs:  # else the caller chose
                kwargs["PDL"] = pdl_active(torch.device("cuda"))
                if kwargs["PDL"]:
                    kwargs["launch_pdl"] = True
            if OPAQUE or _DIRECT.get():
                return self.kernel[grid](*args, **kwargs)
            return wrap_triton(self.kernel)[grid](*args,
                                                  **with_defaults(self.kernel, args, kwargs))

        return launch


def launcher(kernel: Any) -> _Launcher:
    """`wrap_triton(kernel)` (Inductor traces the launch), or with `DLMC_PDL=1` and inside an
    opaque op's body (`direct_launches`; such a body may pass `PDL=True, launch_pdl=True`
    itself) the kernel launched directly, with the PDL attribute where it takes a `PDL`
    constexpr (sm_90+) and the caller passes none.
    Use as `launcher(kernel)[grid](*args, **meta)`."""
    return _Launcher(kernel)
