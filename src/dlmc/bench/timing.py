"""GPU timing helpers shared by `dlmc bench round` and the perf/ scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import torch

R = TypeVar("R")


def drain(events: Generator[Any, None, R]) -> R:
    """Run a decode's event generator to its end; its return value (the decode's output)."""
    while True:
        try:
            next(events)
        except StopIteration as stop:
            return stop.value


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


def graph_us(call: Callable[[int], object], copies: int, iters: int) -> float:
    """Median µs of one call from CUDA-graph replays of `call(0)`, ..., `call(copies - 1)` (on
    distinct weights, say) captured in one graph; where there is no GPU, the median wall clock
    of the calls run one by one (CPU smoke tests of the perf/ scripts)."""
    for i in range(copies):
        call(i)
    if not torch.cuda.is_available():
        return statistics.median(cuda_times(lambda: call(0), iters)) * 1e3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    return statistics.median(cuda_times(graph.replay, iters, warmup=3)) * 1e3 / copies


def launch_floor_us(device: str | torch.device, copies: int, iters: int) -> float:
    """`graph_us` of a one-element add: what a dependent launch costs by itself, the floor that
    perf/'s probes of short kernels compare with."""
    one = torch.zeros(1, device=device)
    return graph_us(lambda _: one.add_(1.0), copies, iters)


def queued_cuda_times(fn: Callable[[], object], iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls of `fn` queued back to back on the current stream
    (no host sync between them): CUDA events between consecutive calls, so each time is the
    device's own, without the host's launch and read-back latency that `cuda_times` includes.
    `fn` must not sync (a graph replay). CUDA only."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for event in events[1:]:
        fn()
        event.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]


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
