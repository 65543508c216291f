import pytest
import torch

from dlmc.bench.timing import graph_us, launch_floor_us


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (no CUDA graph)")
def test_graph_us_runs_every_copy_then_times_the_calls_on_cpu():
    seen = []
    us = graph_us(seen.append, copies=3, iters=4)
    assert seen[:3] == [0, 1, 2]  # each copy once before timing
    assert seen[3:] == [0] * 4  # then `iters` timed calls
    assert us > 0.0


def test_launch_floor_us_times_a_one_element_add():
    us = launch_floor_us("cuda" if torch.cuda.is_available() else "cpu", copies=2, iters=3)
    assert 0.0 < us < 1e5  # a few µs on a GPU, a Python call's wall clock on the CPU
