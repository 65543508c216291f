"""Programmatic dependent launch (PDL) of dlmc's Triton kernels, and how op bodies launch them.

With PDL (sm_90+), a kernel may start while the kernel before it in the stream is finishing:
its programs are scheduled as the previous kernel's programs leave, and wait at `gdc_wait` until
that kernel has completed and its writes are visible. Inside a CUDA graph this hides most of
each launch's start-up behind the previous kernel's tail.

Rules of the kernels that take a `PDL` constexpr: `pdl_enter(PDL)` is their first statement, so
nothing is read or written before the previous kernel is complete; it then lets the next
kernel launch. Kernels without the parameter launch as usual.

Inductor cannot launch a traced kernel with the PDL attribute: only an op registered opaque
(`_registration.traced_triton_op(..., opaque=True)`, e.g. `dlmc::nvfp4_moe`) launches its own
kernels with PDL, passing `PDL_LAUNCH`. Inductor's own kernels use PDL through the compile
site's `KernelConfig.pdl` (`dlmc.graphs.compile`).
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

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (re-exported by `_registration`)


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def device_has_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: a CUDA device of sm_90+ (not under the
    CPU interpreter)."""
    return not INTERPRETED and device.type == "cuda" and _device_has_pdl(
        device.index if device.index is not None else torch.cuda.current_device())


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
    fails on a missing constexpr."""
    return {name: default for i, name, default in _defaults(kernel.fn)
            if i >= len(args) and name not in kwargs} | kwargs


# The launch options with which an opaque op's body launches a kernel that takes a `PDL`
# constexpr with programmatic dependent launch (`launcher` passes them through as given).
PDL_LAUNCH = {"PDL": True, "launch_pdl": True}

# Set while an opaque op's body runs (`_registration.traced_triton_op`): its kernels launch
# directly: `wrap_triton` outside a traced `triton_op` goes through the higher-order op's eager
# path, which costs tens of µs of host time per launch.
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
                kwargs["PDL"] = False
            if _DIRECT.get():
                return self.kernel[grid](*args, **kwargs)
            return wrap_triton(self.kernel)[grid](*args,
                                                  **with_defaults(self.kernel, args, kwargs))

        return launch


def launcher(kernel: Any) -> _Launcher:
    """`wrap_triton(kernel)` (Inductor traces the launch), or inside an opaque op's body
    (`direct_launches`) the kernel launched directly; such a body may pass `PDL_LAUNCH` to
    launch a kernel that takes a `PDL` constexpr with programmatic dependent launch (sm_90+).
    A kernel that takes `PDL` gets `PDL=False` when the caller passes none.
    Use as `launcher(kernel)[grid](*args, **meta)`."""
    return _Launcher(kernel)
