"""dlmc: an inference engine for diffusion language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "KernelConfig", "__version__"]

if TYPE_CHECKING:
    from dlmc.api import LLM
    from dlmc.custom_ops.kernel_config import KernelConfig


def __getattr__(name: str) -> Any:
    # Lazy so that `import dlmc` (and the CLI's --help) does not pay for importing torch.
    if name == "LLM":
        from dlmc.api import LLM

        return LLM
    if name == "KernelConfig":
        from dlmc.custom_ops.kernel_config import KernelConfig

        return KernelConfig
    raise AttributeError(f"module 'dlmc' has no attribute {name!r}")
