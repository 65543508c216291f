"""LLaDA2 MoE block: sigmoid group-limited router with expert bias, routed experts, shared expert.

The routed experts are the MoE seam: any module with
`forward(x [T, H], topk_ids [T, K] int64, topk_weights [T, K] fp32) -> [T, H]` can stand in
(`BF16Experts` here, the NVFP4 experts chosen at load time for NVFP4 checkpoints). On CUDA the
router is `dlmc::router_gemm` + `dlmc::moe_route`; the experts align their pairs themselves.

`fuse_shared_experts(model)` (after loading; off unless called) moves each shared expert into
its layer's experts module as one more expert, id E, which every token takes with weight 1.0
(`forward(..., shared_expert=True)`: the `[T, K+1]` routing, never materialised): one grouped
kernel pair then runs routed + shared experts. `BF16Experts` stack it as expert E;
`NVFP4Experts` keep it in BF16 beside the packed experts (`set_shared_expert`) and `nvfp4_moe`
runs it inside its own launches. Numerics: the fused block sums the routed pairs and the
shared expert's bf16 output in fp32 and rounds once; the unfused block rounds the routed sum to
bf16 and adds the shared output in bf16 (a second rounding). The shared expert's own output is
the same bf16 maths either way (bf16 gate/up, SiLU, product and down), up to fp32 summation order
inside its GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.custom_ops.bf16_moe import bf16_moe, bf16_moe_reference  # noqa: F401 (re-export)
from dlmc.custom_ops.moe_align import append_shared_column
from dlmc.custom_ops.moe_route import moe_route, moe_route_reference
from dlmc.custom_ops.router_gemm import MAX_TOKENS as ROUTER_GEMM_MAX_TOKENS
from dlmc.custom_ops.router_gemm import router_gemm
from dlmc.models.config import LLaDA2Config
from dlmc.models.layers import SwiGLUMLP
from dlmc.models.nvfp4_experts import NVFP4Experts

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _kernel_path(x: torch.Tensor) -> bool:
    """Whether `x` takes the Triton kernels: on CUDA; CPU runs keep the torch maths (tests point
    this at Triton's interpreter)."""
    return x.is_cuda


class Router(nn.Module):
    """HF `mlp.gate`: `weight [E, H]` and the selection-only `expert_bias [E]`, both fp32.

    The router GEMM runs in fp32, so `weight` is an fp32 buffer: the loader keeps buffers in
    their declared dtype, converting the (bf16) checkpoint tensor once instead of every call.
    On CUDA it runs as `dlmc::router_gemm` (BF16 tensor cores on an exact split of the weight,
    split-K partials that `dlmc::moe_route` sums) for bf16 blocks of at most 64 tokens;
    otherwise as `F.linear` in fp32.
    """

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        self.config = config
        self.register_buffer(
            "weight", torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32)
        )
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route `x [T, H]` to `(topk_ids [T, K] int64, topk_weights [T, K] fp32)`."""
        return self.route(self._logits(x), _kernel_path(x))

    def route(self, logits: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_ids, topk_weights)` from the router logits `[T, E]` or their split-K partials
        `[S, T, E]`: one Triton launch (`dlmc::moe_route`) with `kernel`, else the torch maths
        (on CPU the op would interpret the kernel)."""
        cfg = self.config
        route = moe_route if kernel else moe_route_reference
        return route(logits, self.expert_bias.float(), cfg.n_group, cfg.topk_group,
                     cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self._split_gemm(x):
            return router_gemm(x, self.weight.float())  # [S, T, E] fp32, sums to the logits
        return F.linear(x.float(), self.weight.float())  # [T, E] fp32

    def _split_gemm(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16
                and x.shape[0] <= ROUTER_GEMM_MAX_TOKENS)


class BF16Experts(nn.Module):
    """Routed experts stacked per projection: `<proj>_weight [E, out, in]` (HF rows = expert E).

    The loader stacks `mlp.experts.E.<proj>.weight` into slot E of `<proj>_weight`. After
    `MoEBlock.fuse_shared_expert` the tensors hold one more row (the shared expert).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj_weight = nn.Parameter(
            torch.empty(num_experts, intermediate_size, hidden_size)
        )
        self.up_proj_weight = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size)
        )

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        shared_expert: bool = False,
    ) -> torch.Tensor:
        """`[T, H]` from `topk_ids`/`topk_weights [T, K]`; `shared_expert`: every token also
        takes the last expert with weight 1.0 (see `bf16_moe`)."""
        if _kernel_path(x) and x.dtype == torch.bfloat16:  # Triton grouped GEMM (dlmc::bf16_moe)
            return bf16_moe(
                x, topk_ids, topk_weights,
                self.gate_proj_weight, self.up_proj_weight, self.down_proj_weight, shared_expert,
            )
        return grouped_moe(
            x, topk_ids, topk_weights,
            self.gate_proj_weight, self.up_proj_weight, self.down_proj_weight, shared_expert,
        )


def grouped_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared_expert: bool = False,
) -> torch.Tensor:
    """Same maths as `bf16_moe_reference`, sync-free: (token, k) pairs sorted by expert and run
    through `torch._grouped_mm` with device-side offsets, so it compiles with fullgraph and
    captures in a CUDA graph. Shapes as in `bf16_moe_reference`. Other dtypes (fp32 on CPU,
    tests) gather each (token, k) pair's expert weights instead."""
    if shared_expert:  # the [T, K+1] routing: every token also takes expert E-1, weight 1.0
        topk_ids = append_shared_column(topk_ids, gate_proj.shape[0] - 1)
        topk_weights = append_shared_column(topk_weights, 1.0)
    tokens, top_k = topk_ids.shape
    num_experts = gate_proj.shape[0]
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # [T*K]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # [E]
    token_idx = order // top_k  # [T*K]
    xs = x[token_idx]  # [T*K, H]
    if x.dtype == torch.bfloat16:
        gate = torch._grouped_mm(xs, gate_proj.transpose(1, 2), offs=offsets)  # [T*K, I]
        up = torch._grouped_mm(xs, up_proj.transpose(1, 2), offs=offsets)
        hidden = F.silu(gate) * up
        ys = torch._grouped_mm(hidden, down_proj.transpose(1, 2), offs=offsets)  # [T*K, H]
    else:  # _grouped_mm is bf16-only when traced: gather each pair's expert (small models)
        expert_of = flat_ids[order]  # [T*K]
        gate = torch.bmm(gate_proj[expert_of], xs[:, :, None])[..., 0]  # [T*K, I]
        up = torch.bmm(up_proj[expert_of], xs[:, :, None])[..., 0]
        hidden = F.silu(gate) * up
        ys = torch.bmm(down_proj[expert_of], hidden[:, :, None])[..., 0]  # [T*K, H]
    weighted = ys.float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_idx, weighted).to(x.dtype)


class MoEBlock(nn.Module):
    """HF `mlp` of layers >= first_k_dense_replace: `gate`, `experts`, `shared_experts`.

    `shared_expert_id` is None, or (after `fuse_shared_expert`) the expert id of the shared
    expert inside `experts`, with `shared_experts` then None.
    """

    def __init__(self, config: LLaDA2Config, experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = experts or BF16Experts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_experts = (
            SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )
        self.shared_expert_id: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_by(x, *self.gate(x))

    @property
    def router_weight(self) -> torch.Tensor:
        """The router's fp32 `[E, H]` weight, for a caller that computes the logits itself
        (LLaDA2's fused post-attention path, which then calls `routed`)."""
        return self.gate.weight

    def routed(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`forward(x)` with the router's logits (or split-K partials) already computed."""
        return self.routed_by(x, *self.gate.route(logits, _kernel_path(x)))

    def routed_by(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                  ) -> torch.Tensor:
        """The experts (and the shared expert) on `x` with the given routing `[T, K]`."""
        expert_kwargs: dict[str, object] = {}
        if self.shared_expert_id is not None:  # the last expert, every token with weight 1.0
            expert_kwargs["shared_expert"] = True
        routed = self.experts(x, topk_ids, topk_weights, **expert_kwargs)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    @torch.no_grad()
    def fuse_shared_expert(self) -> bool:
        """Move the shared expert into the experts module and drop `shared_experts`; True if
        fused (now or before). Needs a shared expert of the routed experts' width (one shared
        expert) and `BF16Experts` (appended as expert E, row E of each stacked weight; one
        projection at a time, the old stack freed as the new one is made) or `NVFP4Experts`
        (kept in BF16, `NVFP4Experts.set_shared_expert`); anything else stays unfused. Call
        after loading: parameters change shape."""
        if self.shared_expert_id is not None:
            return True
        experts, shared = self.experts, self.shared_experts
        if shared is None or type(experts) not in (BF16Experts, NVFP4Experts):
            return False
        if shared.gate_proj.weight.shape[0] != experts.gate_proj_weight.shape[1]:  # width I
            return False
        if type(experts) is NVFP4Experts:
            self.shared_expert_id = experts.set_shared_expert(
                shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
            self.shared_experts = None
            return True
        for proj in EXPERT_PROJECTIONS:
            name = f"{proj}_weight"
            stacked = experts._parameters[name]  # [E, out, in]
            row = getattr(shared, proj).weight.to(stacked.dtype)  # [out, in]
            experts._parameters[name] = nn.Parameter(
                torch.cat([stacked.data, row[None]]), requires_grad=False
            )  # [E+1, out, in]
            del stacked, row
        self.shared_expert_id = experts.num_experts
        experts.num_experts += 1
        self.shared_experts = None
        return True


def fuse_shared_experts(model: nn.Module) -> int:
    """`MoEBlock.fuse_shared_expert` on every MoE layer of `model`; returns how many fused."""
    return sum(m.fuse_shared_expert() for m in model.modules() if isinstance(m, MoEBlock))
