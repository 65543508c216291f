import pytest
import torch

from dlmc.bench.timing import graph_us


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (no CUDA graph)")
def test_graph_us_runs_every_copy_then_times_the_calls_on_cpu():
    seen = []
    us = graph_us(seen.append, copies=3, iters=4)
    assert seen[:3] == [0, 1, 2]  # each copy once before timing
    assert seen[3:] == [0] * 4  # then `iters` timed calls
    assert us > 0.0
