"""Registration shared by the Triton ops whose body Inductor should trace into."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.library import triton_op

from dlmc.custom_ops._pdl import INTERPRETED, OPAQUE

__all__ = ["INTERPRETED", "traced_triton_op"]


def traced_triton_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any],
                     mutates_args: tuple[str, ...] = (), opaque: bool = False) -> Any:
    """`triton_op(name)` over `impl`: torch.compile traces through the body (its kernels and
    torch ops). Under `TRITON_INTERPRET=1` (CPU tests) interpreted kernels cannot be traced, so
    the same body is registered as an opaque custom op with `fake` as its fake function and
    torch.compile calls it eagerly. So it is with `DLMC_PDL=1` or `opaque` (`_pdl`), whose
    launches Inductor cannot make, and with `opaque` (an op that launches its kernels with PDL
    itself). `mutates_args`: the arguments the body writes in place."""
    if INTERPRETED or OPAQUE or opaque:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(impl)
        op.register_fake(fake)
        return op
    return triton_op(name, mutates_args=mutates_args)(impl)
