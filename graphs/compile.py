"""The one torch.compile site: the round functions compiled by Inductor (fullgraph, static
shapes), keyed by name and `KernelConfig`.

Inductor's FX-graph and autotune caches persist in dlmc's cache directory
(`$DLMC_CACHE/inductor`, `inductor-<hash>` for a non-default `KernelConfig`), so a second start
of the same model and shapes is fast; a `TORCHINDUCTOR_CACHE_DIR` that the user set is used as it
is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config

from dlmc.cache_dir import dlmc_cache_dir
from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError

__all__ = ["compile_options", "compiled", "inductor_cache_dir"]

_compiled: dict[tuple[str, KernelConfig], Callable[..., Any]] = {}


def user_inductor_cache_dir() -> str | None:
    """The user's TORCHINDUCTOR_CACHE_DIR, or None. Importing torch._dynamo (torch.library and
    torch._inductor.config do) sets the variable to Inductor's default directory before this
    module can read it: a value equal to that default counts as unset."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if value is None:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


USER_INDUCTOR_CACHE_DIR = user_inductor_cache_dir()  # read at import, before any compile


def inductor_cache_dir(kernels: KernelConfig = DEFAULT_KERNELS) -> str:
    """Where Inductor keeps its caches for rounds compiled under `kernels` (see the module
    docstring); sets TORCHINDUCTOR_CACHE_DIR to it. One directory per non-default config: the
    config changes code inside dlmc's ops, which Inductor's own cache key may not see."""
    if USER_INDUCTOR_CACHE_DIR:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = USER_INDUCTOR_CACHE_DIR
        return USER_INDUCTOR_CACHE_DIR
    name = "inductor" if kernels == DEFAULT_KERNELS else f"inductor-{kernels.cache_tag()}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path = str(dlmc_cache_dir() / name)
    return path


def compile_options(kernels: KernelConfig = DEFAULT_KERNELS, canvas: bool = False
                    ) -> dict[str, Any]:
    """Inductor options of the compile site under `kernels`: `triton.enable_pdl` from
    `kernels.pdl` (torch keeps it to CUDA sm_90+; it shortens queued rounds, which rounds in
    flight are), unless the user set TORCHINDUCTOR_ENABLE_PDL; `deterministic` from
    `kernels.deterministic_compile`; `split_reductions` False when `kernels.split_reductions`
    is "off", or "auto" for a DiffusionGemma compile (`canvas`)."""
    options: dict[str, Any] = {}
    if "TORCHINDUCTOR_ENABLE_PDL" not in os.environ:
        options["triton.enable_pdl"] = kernels.pdl
    if kernels.deterministic_compile:
        if not hasattr(torch._inductor.config, "deterministic"):
            raise ConfigError("KernelConfig.deterministic_compile needs a torch whose Inductor "
                              f"has a deterministic mode (2.10 or later; this is "
                              f"{torch.__version__})")
        options["deterministic"] = True
    if kernels.split_reductions == "off" or (kernels.split_reductions == "auto" and canvas):
        options["split_reductions"] = False
    return options


def compiled(name: str, fn: Callable[..., Any],
             kernels: KernelConfig = DEFAULT_KERNELS, canvas: bool = False
             ) -> Callable[..., Any]:
    """`fn` compiled once per (name, kernels, canvas) with fullgraph and static shapes (it
    specialises per key length and algorithm, which are Python values); `canvas`: a
    DiffusionGemma step or encoder chunk (`compile_options`)."""
    key = (name, kernels, canvas)
    if key not in _compiled:
        inductor_cache_dir(kernels)
        torch._inductor.config.fx_graph_cache = True
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False,
                                       options=compile_options(kernels, canvas))
    return _compiled[key]
