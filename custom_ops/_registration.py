"""Registration shared by the Triton ops whose body Inductor should trace into."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch.library import triton_op

from dlmc.custom_ops._pdl import INTERPRETED, direct_launches

__all__ = ["INTERPRETED", "traced_triton_op"]


def _resolved_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """`fn`'s signature with its (string) annotations resolved in `fn`'s own module."""
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in sig.parameters.values()]
    ret = hints.get("return", sig.return_annotation)
    return sig.replace(parameters=params, return_annotation=None if ret is type(None) else ret)


def traced_triton_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any],
                     mutates_args: tuple[str, ...] = (), opaque: bool = False) -> Any:
    """`triton_op(name)` over `impl`: torch.compile traces through the body (its kernels and
    torch ops). Under `TRITON_INTERPRET=1` (CPU tests) interpreted kernels cannot be traced, so
    the same body is registered as an opaque custom op with `fake` as its fake function and
    torch.compile calls it eagerly. So it is with `opaque`: an op that launches its kernels
    with PDL itself, which Inductor cannot. `mutates_args`: the arguments the body writes in
    place. An opaque op's body launches its kernels directly (`_pdl.direct_launches`)."""
    if INTERPRETED or opaque:
        @functools.wraps(impl)
        def direct(*args: Any, **kwargs: Any) -> Any:
            with direct_launches():
                return impl(*args, **kwargs)

        direct.__signature__ = _resolved_signature(impl)  # (for the schema, as impl's)
        op = torch.library.custom_op(name, mutates_args=mutates_args)(direct)
        op.register_fake(fake)
        return op
    return triton_op(name, mutates_args=mutates_args)(impl)
