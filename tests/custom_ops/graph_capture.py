"""Compile a function with fullgraph and capture one call of it in a CUDA graph (GPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def compile_and_capture(fn: Callable[..., Any], *inputs: torch.Tensor) -> tuple[Any, Any]:
    """Warm `torch.compile(fn, fullgraph=True)` up on a side stream (compile, autotune), then
    capture it; returns `(graph, outputs)`. Replaying the graph recomputes `outputs` in place
    from whatever `inputs` then hold."""
    compiled = torch.compile(fn, fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = compiled(*inputs)
    return graph, outputs
