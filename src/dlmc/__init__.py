"""dlmc: an inference engine for diffusion language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "__version__"]

if TYPE_CHECKING:
    from dlmc.api import LLM


def __getattr__(name: str) -> Any:
    # Lazy so that `import dlmc` (and the CLI's --help) does not pay for importing torch.
    if name == "LLM":
        from dlmc.api import LLM

        return LLM
    raise AttributeError(f"module 'dlmc' has no attribute {name!r}")
