"""Where a decoder's K/V live: the paged cache (FP8 or BF16) or the dense static cache, and
which settings each can run with."""

from __future__ import annotations

import torch

from dlmc.errors import ConfigError

# Where K/V live: "paged" (the paged cache and its Triton attention: attends exactly the live
# prefix, one graph for every prefix length), "dense" (a static [max_context] cache attended
# up to a power-of-two key-length bucket), or "auto": paged where it runs (CUDA, bf16, static
# rounds), dense elsewhere. An FP8 cache is always paged.
KV_LAYOUTS = ("auto", "dense", "paged")


def paged_cache_problem(device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """Why the paged (FP8 or BF16) cache cannot run with these settings (None: it can), with
    what to pass instead (the option's name in the API and on the command line)."""
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return (f"needs bf16 activations (got dtype {name}); use dtype 'bf16' (--dtype bf16) "
                "or kv_cache_dtype 'bf16'")
    if mode == "reference":
        return ("needs a static round mode (mode 'reference' runs plain PyTorch rounds over "
                "the dense BF16 cache); use mode 'eager' (--mode eager) or kv_cache_dtype "
                "'bf16'")
    if mode == "compile" and device.type != "cuda":
        return ("with mode 'compile' needs a CUDA device (on CPU the paged cache attends with "
                "the reference, which reads its length on the host); use mode 'eager' "
                "(--mode eager) or kv_cache_dtype 'bf16'")
    return None


def uses_paged_cache(kv_layout: str, kv_cache_dtype: str, device: torch.device,
                     dtype: torch.dtype, mode: str) -> bool:
    """Whether K/V go to the paged cache (see KV_LAYOUTS); a combination that cannot run is a
    ConfigError naming the option."""
    problem = paged_cache_problem(device, dtype, mode)
    if kv_cache_dtype == "fp8" and problem:
        raise ConfigError(f"kv_cache_dtype 'fp8' {problem}")
    if kv_layout not in KV_LAYOUTS:
        raise ConfigError(f"kv_layout={kv_layout!r}: expected one of {', '.join(KV_LAYOUTS)}")
    if kv_layout == "paged" and problem:
        raise ConfigError("kv_layout 'paged' " + problem.replace(
            "kv_cache_dtype 'bf16'", "kv_layout 'dense'"))
    if kv_layout == "dense" and kv_cache_dtype == "fp8":
        raise ConfigError("kv_layout 'dense' holds bf16 K/V only; an FP8 cache is paged")
    return kv_cache_dtype == "fp8" or kv_layout == "paged" or (
        kv_layout == "auto" and device.type == "cuda" and problem is None)
