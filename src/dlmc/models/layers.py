"""Building blocks shared by dlmc's models: RMSNorm, partial RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.custom_ops.qk_norm_rope import apply_partial_rope, rms_norm
from dlmc.custom_ops.rope_tables import rope_inv_freq, rope_tables, rope_tables_reference
from dlmc.custom_ops.small_m_linear import MAX_TOKENS, small_m_linear
from dlmc.custom_ops.split_k_linear import split_k_linear
from dlmc.env import env_choice

__all__ = ["RMSNorm", "SwiGLUMLP", "apply_partial_rope", "env_choice", "fuse_gate_up_projections",
           "linear", "qkv_split_k", "rms_norm", "rope_cos_sin", "small_m_gemm", "takes_split_k",
           "wide_gemm"]


def small_m_gemm() -> str:
    """How the dense projections of a few bf16 tokens run on CUDA, from `DLMC_SMALL_M_GEMM`:
    "splitk" (the default: `dlmc::split_k_linear`'s partials, summed where the product is used,
    as Inductor fuses the sum into the residual add and RMSNorm after it; only for o_proj and
    the dense MLP's down projection, the others run cuBLAS, see `wide_gemm`; H200: o_proj 5.1
    against 6.2 µs, the NVFP4 round 3.054 against 3.076 ms, perf/README.md session 19),
    "cublas" (`F.linear` everywhere) or "triton" (`dlmc::small_m_linear`)."""
    return env_choice("DLMC_SMALL_M_GEMM", "splitk", ("cublas", "triton", "splitk"))


def wide_gemm(gemm: str) -> str:
    """The choice for qkv (under `DLMC_QKV_SPLIT_K=0`) and the dense MLP's gate/up under `gemm`:
    "splitk" is "cublas" there (gate/up's [10240, 2048] runs faster in cuBLAS: perf/README.md,
    session 19)."""
    return "cublas" if gemm == "splitk" else gemm


def qkv_split_k() -> bool:
    """`DLMC_QKV_SPLIT_K` ("1" default, "0"): under `DLMC_SMALL_M_GEMM=splitk`, the attention's
    qkv projection also runs `dlmc::split_k_linear`, whose fp32 partials the q/k norm + rope
    kernel sums as it reads them (no reduction launch; perf/README.md, sessions 34-35)."""
    return env_choice("DLMC_QKV_SPLIT_K", "1", ("0", "1")) == "1"


def _small_m_input(x: torch.Tensor) -> bool:
    """Whether dlmc's small-M GEMMs take `x`: a bf16 CUDA `[T <= 64, K]`."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] <= MAX_TOKENS)


def takes_split_k(x: torch.Tensor, gemm: str) -> bool:
    """Whether `linear` under `gemm` runs `dlmc::split_k_linear` for `x`."""
    return gemm == "splitk" and _small_m_input(x)


def linear(x: torch.Tensor, weight: torch.Tensor, gemm: str) -> torch.Tensor:
    """`F.linear(x, weight)` (bf16), through `dlmc::small_m_linear` or `dlmc::split_k_linear`
    when `gemm` is "triton" or "splitk" and `x` is a bf16 CUDA tensor of at most 64 rows."""
    if gemm != "cublas" and _small_m_input(x):
        if gemm == "splitk":  # one rounding of the fp32 sum, as F.linear's accumulator
            return split_k_linear(x, weight).sum(0).to(torch.bfloat16)
        return small_m_linear(x, weight)
    return F.linear(x, weight)


class RMSNorm(nn.Module):
    """`w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`; the weight is used as is (not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[T, rotary_dim]` for absolute `positions [T]`, computed in fp32.

    `inv_freq[i] = theta^(-2i/rotary_dim)`; the table is `cat(angles, angles)`. Bf16 tables of
    CUDA positions come from one `dlmc::rope_tables` launch (the same values), others from the
    torch ops of `rope_tables_reference`.
    """
    inv_freq = rope_inv_freq(rotary_dim, theta, positions.device)
    if positions.is_cuda and dtype == torch.bfloat16:
        return rope_tables(positions, inv_freq)
    return rope_tables_reference(positions, inv_freq, dtype)


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with HF names gate_proj / up_proj / down_proj.

    After `fuse_gate_up` one `gate_up_weight [2I, H]` holds both projections (one GEMM instead
    of two); `gate_proj.weight` and `up_proj.weight` become views of it, so the HF names, state
    dicts and loading keep working.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_parameter("gate_up_weight", None)
        self.gemm = small_m_gemm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, wide_gemm(self.gemm)).chunk(2, dim=-1)
        else:  # [T, I] each
            gate = linear(x, self.gate_proj.weight, wide_gemm(self.gemm))
            up = linear(x, self.up_proj.weight, wide_gemm(self.gemm))
        return linear(F.silu(gate) * up, self.down_proj.weight, self.gemm)

    @torch.no_grad()
    def fuse_gate_up(self) -> None:
        """Concatenate the gate and up weights into `gate_up_weight` (call after loading)."""
        if self.gate_up_weight is not None:
            return
        inter = self.gate_proj.weight.shape[0]
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # [2I, H]
        del self.gate_proj.weight, self.up_proj.weight
        self.gate_up_weight = nn.Parameter(fused, requires_grad=False)
        self.gate_proj.weight = nn.Parameter(fused[:inter], requires_grad=False)  # views
        self.up_proj.weight = nn.Parameter(fused[inter:], requires_grad=False)


def fuse_gate_up_projections(model: nn.Module) -> int:
    """`SwiGLUMLP.fuse_gate_up` on every dense SwiGLU MLP of `model`; returns how many."""
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    for mlp in mlps:
        mlp.fuse_gate_up()
    return len(mlps)
