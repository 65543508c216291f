"""Resident programs per SM of a compiled Triton or Gluon kernel: the CUDA driver's occupancy
calculator (`cuOccupancyMaxActiveBlocksPerMultiprocessor`, through ctypes). A persistent kernel
sized by what fits at once asks it for its grid (`_nvfp4_gate_up_gluon`)."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["resident_programs"]

_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute
_MAX_SHARED = 100  # carveout percent: all of the unified L1 / shared memory that can be shared


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
        ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def resident_programs(compiled: object, threads: int) -> int:
    """Programs of `compiled` (a `CompiledKernel`, launched with `threads` threads and its
    `metadata.shared` bytes of shared memory) that fit on one SM at once, after asking the
    driver for the largest shared-memory carveout (without it the driver may pick a smaller
    one and fit fewer programs than the shared memory per SM allows)."""
    compiled._init_handles()  # loads the module: `function` is the CUfunction
    lib = _libcuda()
    function = ctypes.c_void_p(compiled.function)
    rc = lib.cuFuncSetAttribute(function, _PREFERRED_SHARED_MEMORY_CARVEOUT, _MAX_SHARED)
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred carveout) failed: CUresult {rc}")
    count = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), function, threads,
                                                         compiled.metadata.shared)
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: CUresult {rc}")
    return count.value
