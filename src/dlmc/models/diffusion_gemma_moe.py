"""DiffusionGemma's MoE: the softmax router with `per_expert_scale` and the gelu-tanh experts.

`GemmaExperts` is the MoE seam of this model, as `BF16Experts` is LLaDA2's: any module with
`forward(x [T, H], topk_ids [T, K] int64, topk_weights [T, K] fp32) -> [T, H]` can stand in
(quantized experts chosen at load time). BF16 experts on CUDA run through `dlmc::bf16_moe`
reading the fused gate_up weights in place (`KernelConfig.gemma_bf16_experts`, "auto"), else
through `torch._grouped_mm`.
"""

from __future__ import annotations

import torch
from torch import nn

from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.bf16_moe import bf16_moe
from dlmc.custom_ops.gemma_route import gemma_route, gemma_route_reference
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.models.diffusion_gemma_layers import GemmaRMSNorm, gelu_tanh


class GemmaRouter(nn.Module):
    """Checkpoint `router.{proj.weight, scale, per_expert_scale}`.

    `z = rmsnorm_noscale(h) * scale * hidden^-0.5`, `p = softmax(proj(z))` over all experts in
    fp32, the top k renormalised to sum to 1, then each multiplied by `per_expert_scale` of its
    expert (`gemma_route_reference`; on CUDA `dlmc::gemma_route`, one launch). The projection
    runs in the activation dtype, as transformers runs it (near-ties in the top k depend on
    it).
    """

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The un-normed residual `h [T, H]` -> `(topk_ids [T, K] int64, topk_weights [T, K]
        fp32)`."""
        z = self.norm(h) * self.scale * self.root_size  # [T, H]
        route = gemma_route if h.is_cuda else gemma_route_reference  # one launch on the GPU
        return route(self.proj(z), self.per_expert_scale, self.top_k)  # [T, K] each


class GemmaExperts(nn.Module):
    """Checkpoint `experts.gate_up_proj [E, 2I, H]` (rows `:I` gate, `I:` up) and
    `experts.down_proj [E, H, I]`; expert e maps x to `down[e] @ (gelu_tanh(g) * u)`.

    `kernel` (`KernelConfig.gemma_bf16_experts`, set by `apply_kernel_config`): with "triton",
    bf16 inputs on CUDA (and on CPU under Triton's interpreter, for tests), with "auto" bf16
    inputs on CUDA, run `dlmc::bf16_moe(activation="gelu_tanh")` over the two halves of
    `gate_up_proj`, the same maths as `grouped_gelu_moe` up to the order of fp32 sums."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.kernel = "auto"

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """`[T, H]`: the sum over k of `topk_weights[t, k]` times expert `topk_ids[t, k]`'s
        output for token t."""
        triton = x.is_cuda or (self.kernel == "triton" and INTERPRETED)
        if self.kernel != "grouped_mm" and x.dtype == torch.bfloat16 and triton:
            inter = self.down_proj.shape[2]
            return bf16_moe(x, topk_ids, topk_weights, self.gate_up_proj[:, :inter],
                            self.gate_up_proj[:, inter:], self.down_proj,
                            activation="gelu_tanh")  # [T, H] bf16
        return grouped_gelu_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)


def grouped_gelu_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Sync-free grouped experts: the (token, k) pairs sorted by expert, then bf16 through
    `torch._grouped_mm` with device-side offsets (compiles with fullgraph, captures in a CUDA
    graph); other dtypes gather each pair's expert weights (`bmm`). The weighted pair outputs
    are summed per token in fp32 and rounded once.

    x `[T, H]`, topk_ids `[T, K]` int64, topk_weights `[T, K]`, gate_up_proj `[E, 2I, H]`,
    down_proj `[E, H, I]` -> `[T, H]` in x's dtype.
    """
    tokens, top_k = topk_ids.shape
    num_experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # [T*K]
    token_idx = order // top_k  # [T*K]
    xs = x[token_idx]  # [T*K, H]
    if x.dtype == torch.bfloat16:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)  # [E]
        gate_up = torch._grouped_mm(xs, gate_up_proj.transpose(1, 2), offs=offsets)  # [T*K, 2I]
        hidden = gelu_tanh(gate_up[:, :inter]) * gate_up[:, inter:]  # [T*K, I]
        ys = torch._grouped_mm(hidden, down_proj.transpose(1, 2), offs=offsets)  # [T*K, H]
    else:  # _grouped_mm is bf16-only when traced: gather each pair's expert (small models)
        expert_of = flat_ids[order]  # [T*K]
        gate_up = torch.bmm(gate_up_proj[expert_of], xs[:, :, None])[..., 0]  # [T*K, 2I]
        hidden = gelu_tanh(gate_up[:, :inter]) * gate_up[:, inter:]  # [T*K, I]
        ys = torch.bmm(down_proj[expert_of], hidden[:, :, None])[..., 0]  # [T*K, H]
    weighted = ys.float() * topk_weights.reshape(-1)[order, None].float()  # [T*K, H]
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_idx, weighted).to(x.dtype)  # [T, H]

