"""`KernelConfig`: the kernel choices of one engine, passed down explicitly.

`LLM(kernels=...)` hands it to the model's ops (at load), the KV cache (attention backend) and
the compile site (`dlmc.graphs.compile`), which keys its compiled functions and Inductor's cache
directory by it. Nothing reads a kernel choice from the environment: an op's output depends
only on its arguments and the device. The defaults are the measured fastest choices on an H200
(docs/nvfp4.md, "Why this default").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from dlmc.custom_ops.nvfp4_moe_tiles import NVFP4Tiles
from dlmc.errors import ConfigError

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_KERNELS", "GEMMA_ATTENTION", "GEMMA_BF16_EXPERTS",
           "GEMMA_SAMPLER", "SPLIT_REDUCTIONS", "KernelConfig"]

# "auto": the Triton paged attention on CUDA, the plain-PyTorch reference elsewhere.
ATTENTION_BACKENDS = ("auto", "triton", "reference")
# DiffusionGemma's BF16 routed experts: two `torch._grouped_mm`, or `dlmc::bf16_moe`.
GEMMA_BF16_EXPERTS = ("auto", "grouped_mm", "triton")
GEMMA_ATTENTION = ("auto", "torch", "triton")
GEMMA_SAMPLER = ("auto", "torch", "triton")
# Inductor's split reductions: "auto" is off for DiffusionGemma's canvas compiles, on elsewhere.
SPLIT_REDUCTIONS = ("auto", "on", "off")
_ANY_TILES = NVFP4Tiles(16, 128, 128, 128, 128)  # a base for checking `nvfp4_tiles` alone


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices that change how a round runs, never what it computes (up to the order of
    floating-point sums where stated).

    Attributes:
        attention_backend: the paged KV cache's attention: "auto", "triton" (dlmc's split +
            merge kernels) or "reference" (plain PyTorch; slow, for debugging).
        pdl: programmatic dependent launch (sm_90+): Inductor launches its kernels with it, and
            `dlmc::nvfp4_moe` overlaps its down launch with its gate/up launch. Bit for bit the
            same results either way; off only to measure what it gains.
        deterministic_compile: Inductor's deterministic mode (no timing-based choice of a
            reduction's block size or warps), so that two compiles give the same numbers.
        gemma_bf16_experts: DiffusionGemma's BF16 routed experts: "grouped_mm" (two
            `torch._grouped_mm` and Inductor's gelu-tanh) or "triton" (`dlmc::bf16_moe` with
            `activation="gelu_tanh"`, the fused gate_up weights read in place; the same maths
            up to the order of fp32 sums); "auto": triton for bf16 on CUDA, else grouped_mm.
        gemma_attention: DiffusionGemma's compiled denoising steps and encoder chunks attend
            the static cache with "torch" (plain PyTorch, compiled by Inductor) or "triton"
            (`dlmc::paged_attention` over the cache viewed as pages; bf16 activations; the
            same maths up to the order of fp32 sums and P rounded to bf16; an FP8 cache's
            rows dequantized in registers); "auto": triton for bf16 activations on CUDA, else
            torch.
        gemma_sampler: DiffusionGemma's denoising steps (the runner's modes) take their
            proposal (tempered logits, sample, argmax, entropy, the next self-conditioning
            input) from "torch" (torch ops; Inductor's reductions when compiled) or "triton"
            (`dlmc::canvas_propose`: the vocabulary split into chunks, one read of the logits
            and the noise; the same maths up to the order of fp32 sums); "auto": triton on
            CUDA, else torch.
        gemma_fused_projections: DiffusionGemma's q/k/v projections (full layers: q/k) and its
            dense MLPs' gate/up as one matrix product each, their weights concatenated at load
            (the per-projection weights become views into it; the same maths, cuBLAS may sum
            in another order); on by default (the BF16 canvas step measured 1.1 % faster with
            it).
        fused_post_attention_norm: LLaDA2's MoE layers on the split-K path (bf16 CUDA blocks
            of at most 64 tokens) run o_proj + residual + the post-attention RMSNorm + the
            router GEMM as two launches (`dlmc::linear_residual`, `dlmc::norm_router_gemm`)
            instead of three; the same maths up to the order of the norm's fp32 sum.
        nvfp4_pad_experts: NVFP4 experts whose width is not a multiple of 128 (DiffusionGemma's
            704) widened at load with zero weights and scales to the next multiple, so that
            they take kernel v7's layout instead of v3 (`NVFP4Experts.pad_to_layout`; the same
            maths up to the order of fp32 sums, 9 % more expert bytes at 704); on by default
            (the NVFP4 + FP8 canvas step measured 4.5 % faster with it).
        nvfp4_tiles: the NVFP4 experts' `NVFP4Tiles` as changes to the op's own choice for
            each call's shape ("block_m=32,down_warps=8"; `NVFP4Tiles.parse`): both projections
            then run in the Triton kernels with them (no Gluon kernel). Empty (the default): the
            op's choice. The same maths up to the order of fp32 sums.
        split_reductions: "on": Inductor splits a reduction over few long rows into partial
            reductions (its default); "off": each row is one program, which lets Inductor use
            its online softmax (DiffusionGemma's sampler over 256 rows of 262k logits; the
            BF16 canvas step measured 3.4 % faster). The same maths up to the order of fp32
            sums. "auto": off for DiffusionGemma's compiled steps and encoder chunks, on for
            LLaDA2's rounds (not measured off).
    """

    attention_backend: str = "auto"
    pdl: bool = True
    deterministic_compile: bool = False
    gemma_bf16_experts: str = "auto"
    gemma_attention: str = "auto"
    gemma_sampler: str = "auto"
    gemma_fused_projections: bool = True
    fused_post_attention_norm: bool = True
    nvfp4_pad_experts: bool = True
    nvfp4_tiles: str = ""
    split_reductions: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in (("attention_backend", ATTENTION_BACKENDS),
                              ("gemma_bf16_experts", GEMMA_BF16_EXPERTS),
                              ("gemma_attention", GEMMA_ATTENTION),
                              ("gemma_sampler", GEMMA_SAMPLER),
                              ("split_reductions", SPLIT_REDUCTIONS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"KernelConfig.{name}={getattr(self, name)!r}: "
                                  f"expected one of {', '.join(choices)}")
        for name in ("pdl", "deterministic_compile", "gemma_fused_projections",
                     "fused_post_attention_norm", "nvfp4_pad_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"KernelConfig.{name}={getattr(self, name)!r}: expected "
                                  "True or False")
        if not isinstance(self.nvfp4_tiles, str):
            raise ConfigError(f"KernelConfig.nvfp4_tiles={self.nvfp4_tiles!r}: expected a "
                              "string of name=value changes")
        try:
            NVFP4Tiles.parse(self.nvfp4_tiles, _ANY_TILES)
        except ValueError as err:
            raise ConfigError(f"KernelConfig.nvfp4_tiles={self.nvfp4_tiles!r}: {err}") from None

    def triton_gemma_sampler(self, device_type: str) -> bool:
        """Whether DiffusionGemma's steps on a device of this type ("cuda", "cpu") take their
        proposal from `dlmc::canvas_propose` (`gemma_sampler`)."""
        return self.gemma_sampler == "triton" or (self.gemma_sampler == "auto"
                                                  and device_type == "cuda")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (recorded by `dlmc bench round`)."""
        return dataclasses.asdict(self)

    def cache_tag(self) -> str:
        """A short stable hash of the fields: the compile-cache key of non-default configs."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self) -> str:
        """`name=value` of every field, for logs and tables."""
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items())


DEFAULT_KERNELS = KernelConfig()
