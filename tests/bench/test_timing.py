import pytest
import torch

from dlmc.bench import timing
from dlmc.bench.timing import graph_us, launch_floor_us


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (no CUDA graph)")
def test_graph_us_runs_every_copy_then_times_the_calls_on_cpu():
    seen = []
    us = graph_us(seen.append, copies=3, iters=4)
    assert seen[:3] == [0, 1, 2]  # each copy once before timing
    assert seen[3:] == [0] * 4  # then `iters` timed calls
    assert us > 0.0


class _Clock:
    """`time.perf_counter` stand-in: each timed call takes the next of `durations_s`."""

    def __init__(self, durations_s: list[float]) -> None:
        self.now, self.durations, self.reads = 0.0, list(durations_s), 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the read after a call: that call's duration later
            self.now += self.durations.pop(0)
        else:
            self.now += 1.0  # time between calls, never counted
        return self.now


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (no CUDA graph)")
def test_launch_floor_us_is_the_median_microseconds_of_the_timed_adds_on_cpu(monkeypatch):
    """On the CPU: every copy once, then `iters` timed adds of 1 to a one-element tensor; the
    median of their durations, in µs (6 ms, 1 ms, 2 ms: 2000 µs)."""
    made = []
    zeros = torch.zeros

    def tracked_zeros(*args, **kwargs):
        made.append(zeros(*args, **kwargs))
        return made[-1]

    clock = _Clock([6e-3, 1e-3, 2e-3])
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    monkeypatch.setattr(timing.torch, "zeros", tracked_zeros)
    us = launch_floor_us("cpu", copies=2, iters=3)
    assert us == pytest.approx(2000.0)
    assert clock.reads == 6 and not clock.durations  # 3 timed calls
    assert len(made) == 1 and made[0].shape == (1,) and made[0].item() == 2 + 3  # adds ran


@pytest.mark.gpu
def test_launch_floor_us_of_a_one_element_add_is_a_few_microseconds_on_cuda():
    """Graph replays of 64 dependent one-element adds, per add: a launch costs a few µs on
    H100/H200; a time per graph (not divided by the 64 copies) would be well above 50 µs, one
    in ms well below 0.1."""
    us = launch_floor_us("cuda", copies=64, iters=20)
    assert 0.1 < us < 50.0
