"""GPU timing helpers shared by `dlmc bench round` and the perf/ scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def cuda_times(fn: Callable[[], object], iters: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of `iters` calls of `fn`, measured with CUDA events (wall clock
    where there is no GPU: CPU smoke tests of the benchmarks)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        return times
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth_gbps(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written) on random data, median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = statistics.median(cuda_times(lambda: dst.copy_(src), iters, warmup=5))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def read_bandwidth_gbps(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device read bandwidth in GB/s: a sum over `nbytes` of random fp32 (bytes read only,
    median). A second ceiling beside the copy: the MoE kernels mostly read."""
    src = torch.rand(nbytes // 4, device="cuda")
    out = torch.empty((), device="cuda")
    ms = statistics.median(cuda_times(lambda: torch.sum(src, dim=0, out=out), iters, warmup=5))
    return nbytes / (ms * 1e-3) / 1e9
