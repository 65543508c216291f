"""Building blocks shared by dlmc's models: RMSNorm, partial RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.custom_ops.qk_norm_rope import apply_partial_rope, rms_norm
from dlmc.custom_ops.rope_tables import cos_sin_tables, rope_inv_freq
from dlmc.custom_ops.split_k_linear import MAX_TOKENS, split_k_linear

__all__ = ["RMSNorm", "SwiGLUMLP", "apply_partial_rope", "fuse_gate_up_projections",
           "fuse_linears", "rms_norm", "rope_cos_sin", "split_k_or_linear", "takes_split_k"]


def takes_split_k(x: torch.Tensor) -> bool:
    """Whether `x` takes `dlmc::split_k_linear`: a bf16 CUDA `[T <= 64, K]` (a denoising block;
    longer inputs are cuBLAS's)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] <= MAX_TOKENS)


def split_k_or_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)`, through `dlmc::split_k_linear` where `takes_split_k(x)`: its fp32
    partials summed where the product is used (Inductor fuses the sum into the residual add and
    RMSNorm after it) and rounded once, as `F.linear`'s accumulator. Used for the narrow
    projections (o_proj, the dense MLP's down projection); cuBLAS is faster for the wide ones."""
    if takes_split_k(x):
        return split_k_linear(x, weight).sum(0).to(torch.bfloat16)
    return F.linear(x, weight)


@torch.no_grad()
def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One `[sum N_i, K]` weight for bias-free linears of the same input width (concatenated in
    the given order); each linear's weight becomes a view into it (the checkpoint names and the
    values stay, the memory is not doubled). `F.linear(x, fused).split(N_i, -1)` is then the
    linears' outputs in one matrix product."""
    fused = torch.cat([linear.weight for linear in linears], dim=0)
    for linear, part in zip(linears, fused.split([lin.out_features for lin in linears]),
                            strict=True):
        linear.weight = nn.Parameter(part, requires_grad=linear.weight.requires_grad)
    return fused


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
    return cos_sin_tables(positions, rope_inv_freq(rotary_dim, theta, positions.device), dtype)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:  # [T, I] each
            gate = F.linear(x, self.gate_proj.weight)
            up = F.linear(x, self.up_proj.weight)
        return split_k_or_linear(F.silu(gate) * up, self.down_proj.weight)

    def fuse_gate_up(self) -> None:
        """Concatenate the gate and up weights into `gate_up_weight` (`fuse_linears`; call
        after loading)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = nn.Parameter(fuse_linears(self.gate_proj, self.up_proj),
                                               requires_grad=False)


def fuse_gate_up_projections(model: nn.Module) -> int:
    """`SwiGLUMLP.fuse_gate_up` on every dense SwiGLU MLP of `model`; returns how many."""
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    for mlp in mlps:
        mlp.fuse_gate_up()
    return len(mlps)
