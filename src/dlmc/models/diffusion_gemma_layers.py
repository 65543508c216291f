"""DiffusionGemma's building blocks: Gemma-4 RMSNorm, per-layer-type RoPE, the gelu-tanh gated
MLP (dense MLP and self-conditioning), the scaled embedding and the self-conditioning input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.models.diffusion_gemma_config import RopeParameters
from dlmc.models.layers import fuse_linears


class GemmaRMSNorm(nn.Module):
    """`cast(x32 * (mean(x32^2) + eps)^-0.5 * w32)`: fp32 throughout, the weight multiplied as is
    (not 1 + w) before the cast; `with_scale=False` omits the weight (v_norm, the router norm,
    the self-conditioning post-norm)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # pow(., -0.5) as transformers computes it (rsqrt may round differently)
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            normed = normed * self.weight.float()
        return normed.to(x.dtype)


def rope_inv_freq(rope: RopeParameters, head_dim: int, device: torch.device) -> torch.Tensor:
    """fp32 `[head_dim / 2]`: `theta^(-2i / head_dim) / factor` for the first `rotated_pairs`
    pairs, 0 for the rest (proportional RoPE; `default` rotates every pair)."""
    pairs = rope.rotated_pairs(head_dim)
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (rope.rope_theta ** (exponents / head_dim))  # [pairs]
    unrotated = torch.zeros(head_dim // 2 - pairs, dtype=torch.float32, device=device)
    return torch.cat([inv_freq, unrotated]) / rope.factor  # [head_dim / 2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head of `x [T, heads, D]` with cos/sin `[T, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))` with checkpoint names gate_proj / up_proj /
    down_proj. After `fuse_projections`, gate and up are one matrix product."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # (`fuse_projections`)

    def fuse_projections(self) -> None:
        """gate_proj and up_proj as one `[2I, H]` weight (`fuse_linears`); idempotent."""
        if self.gate_up_weight is None:
            self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)  # [T, I] each
            return self.down_proj(gelu_tanh(gate) * up)  # [T, H]
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))  # [T, H]


class ScaledEmbedding(nn.Embedding):
    """`E[ids] * embed_scale`, the scale (sqrt(hidden)) cast to the weight dtype first (53.0, not
    53.07, in bf16)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale_value = embedding_dim**0.5

    def scale(self) -> torch.Tensor:
        """The 0-dim scale in the weight's dtype."""
        return torch.tensor(self.embed_scale_value, device=self.weight.device).to(
            self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale()  # [T, H]


class SelfConditioning(nn.Module):
    """The decoder's input: `post_norm(e + down(gelu_tanh(gate(n)) * up(n)))`, `n =
    pre_norm(softmax(sc_logits) @ E * embed_scale)`; post_norm has no weight.

    Without logits (the first step) the soft embedding is zero, so the MLP's output is exactly
    zero and only the post-norm applies.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = GemmaRMSNorm(hidden_size, eps)
        self.post_norm = GemmaRMSNorm(hidden_size, eps, with_scale=False)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, embeds: torch.Tensor, logits: torch.Tensor | None,
                embed_tokens: ScaledEmbedding) -> torch.Tensor:
        """embeds `[T, H]`, logits `[T, V]` or None -> `[T, H]`."""
        if logits is None:
            return self.post_norm(embeds)
        table = embed_tokens.weight  # [V, H]
        probs = logits.softmax(dim=-1, dtype=torch.float32).to(table.dtype)  # [T, V]
        soft = (probs @ table) * embed_tokens.scale().to(embeds.dtype)  # [T, H]
        normed = self.pre_norm(soft)
        signal = self.down_proj(gelu_tanh(self.gate_proj(normed)) * self.up_proj(normed))
        return self.post_norm(embeds + signal)  # [T, H]
