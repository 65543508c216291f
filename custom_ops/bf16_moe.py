"""`dlmc::bf16_moe`: routed-expert MoE over BF16 expert weights (Triton grouped GEMM).

Same structure as `dlmc::nvfp4_moe` (docs/nvfp4.md §3.2) with plain BF16 weight tiles: (token, k)
pairs are grouped per expert into M-blocks (`moe_align`), one kernel computes
`h = act(x @ gate^T) * (x @ up^T)` (`act`: SiLU for LLaDA2, gelu-tanh for DiffusionGemma) per
M-block and N-tile of the expert width, a second computes
`y = h @ down^T`; the bf16 pair outputs are weighted and combined in fp32 (`moe_combine`). Each
touched expert's weights are streamed once per round. A shared expert stacked last
(`shared_expert=True`) runs in the same two kernels, as blocks of all tokens after the routed ones.
gate and up may be the two halves of a fused `gate_up_proj [E, 2I, H]` (DiffusionGemma's
checkpoint layout): the kernels step from expert to expert by the views' own stride, so no weight
is copied. The maths is `bf16_moe_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_align import append_shared_column, block_rows, route_pairs
from dlmc.custom_ops.moe_combine import combine_pairs
from dlmc.custom_ops.nvfp4_moe_tiles import ACTIVATIONS
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["activate", "bf16_down_block", "bf16_down_rows", "bf16_gate_up_block",
           "bf16_gate_up_rows", "bf16_moe", "bf16_moe_reference", "bf16_tile_dot"]

# Launch config of each kernel: (BLOCK_N, BLOCK_K, num_warps, num_stages). perf/bench_bf16_moe.py
# sweeps other configs by replacing entries of `_LAUNCH` (read at each call, eager launches).
_DEFAULT_LAUNCH = {"gate_up": (64, 128, 4, 3), "down": (64, 128, 4, 3)}
_LAUNCH = dict(_DEFAULT_LAUNCH)
_BLOCK_M: int | None = None  # rows per M-block; None: `route_block_m`'s (the bench sweeps it)


@triton.jit
def activate(g, ACTIVATION: tl.constexpr, INTERPRETED: tl.constexpr):
    """`act(g)` in fp32. "silu": `g * sigmoid(g)`. "gelu_tanh": PyTorch's
    `gelu(g, approximate="tanh")` in its order, `0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715
    * g^3)))`, with CUDA's `tanhf` (libdevice); the interpreter has no libdevice, so there
    `1 + tanh(z)` is `2 * sigmoid(2z)` (the same value, without cancellation)."""
    if ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        if INTERPRETED:
            act = g * tl.sigmoid(2.0 * inner)
        else:
            act = 0.5 * g * (1.0 + libdevice.tanh(inner))
    else:
        tl.static_assert(ACTIVATION == "silu", "ACTIVATION: 'silu' or 'gelu_tanh'")
        act = g * tl.sigmoid(g)
    return act


@triton.jit
def bf16_tile_dot(acc, a_ptr, a_rows, row_mask, stride_a, w_ptr, n_offs, n_mask,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc[BM, BN] += A[rows, :K] @ W[n, :K]^T with W bf16 row-major `[N, K]`."""
    k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        kmask = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :],
                    mask=row_mask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + n_offs[None, :] * K + kk[:, None],
                    mask=kmask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if INTERPRETED:  # the interpreter multiplies bf16 as raw integers: dot in fp32
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(a, w)
    return acc


@triton.jit
def bf16_gate_up_rows(a_ptr, a_rows, row_mask, gate_w, up_w, h_ptr, h_rows, n_offs, n_mask,
                      H: tl.constexpr, stride_a, stride_h, BLOCK_K: tl.constexpr,
                      INTERPRETED: tl.constexpr, ACTIVATION: tl.constexpr):
    """h[h_rows, n_offs] = bf16(bf16(act(g)) * u) for A rows `a_rows` (`row_mask`: the rows
    to compute and store), `g`, `u` the bf16-rounded projections by gate/up `[I, H]` (the bf16
    maths of `SwiGLUMLP` and `GatedMLP`); `act` the `ACTIVATION`, "silu" or "gelu_tanh"
    (`activate`)."""
    zeros = tl.zeros((a_rows.shape[0], n_offs.shape[0]), dtype=tl.float32)
    acc_g = bf16_tile_dot(zeros, a_ptr, a_rows, row_mask, stride_a, gate_w, n_offs, n_mask, H,
                          BLOCK_K, INTERPRETED)
    acc_u = bf16_tile_dot(zeros, a_ptr, a_rows, row_mask, stride_a, up_w, n_offs, n_mask, H,
                          BLOCK_K, INTERPRETED)
    g = round_bf16(acc_g, INTERPRETED).to(tl.float32)
    u = round_bf16(acc_u, INTERPRETED).to(tl.float32)
    h = round_bf16(activate(g, ACTIVATION, INTERPRETED), INTERPRETED).to(tl.float32) * u
    tl.store(h_ptr + h_rows[:, None] * stride_h + n_offs[None, :], round_bf16(h, INTERPRETED),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def bf16_down_rows(h_ptr, h_rows, row_mask, down_w, y_ptr, y_rows, n_offs, n_mask,
                   I: tl.constexpr, stride_h, stride_y, BLOCK_K: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """y[y_rows, n_offs] = bf16(h[h_rows] @ down^T), down `[H, I]`, rows masked by `row_mask`."""
    acc = bf16_tile_dot(tl.zeros((h_rows.shape[0], n_offs.shape[0]), dtype=tl.float32), h_ptr,
                        h_rows, row_mask, stride_h, down_w, n_offs, n_mask, I, BLOCK_K,
                        INTERPRETED)
    tl.store(y_ptr + y_rows[:, None].to(tl.int64) * stride_y + n_offs[None, :],
             round_bf16(acc, INTERPRETED), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def bf16_gate_up_block(a_ptr, sorted_pair_ptr, gate_w, up_w, h_ptr, num_pairs, a_row_div, pid_m,
                       pid_n, H: tl.constexpr, I: tl.constexpr, stride_a, stride_h,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRETED: tl.constexpr, ACTIVATION: tl.constexpr):
    """`bf16_gate_up_rows` for one M-block and N-tile of one expert's gate/up `[I, H]`."""
    slots, _, row_mask, a_rows, n_offs, n_mask = block_rows(
        sorted_pair_ptr, num_pairs, a_row_div, pid_m, pid_n, I, BLOCK_M, BLOCK_N)
    bf16_gate_up_rows(a_ptr, a_rows, row_mask, gate_w, up_w, h_ptr, slots, n_offs, n_mask, H,
                      stride_a, stride_h, BLOCK_K, INTERPRETED, ACTIVATION)


@triton.jit
def bf16_down_block(h_ptr, sorted_pair_ptr, down_w, y_ptr, num_pairs, pid_m, pid_n,
                    H: tl.constexpr, I: tl.constexpr, stride_h, stride_y, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """y[pair] = bf16(h[slot] @ down^T) for one M-block and N-tile, down `[H, I]` one expert's."""
    slots, pairs, row_mask, _, n_offs, n_mask = block_rows(
        sorted_pair_ptr, num_pairs, 1, pid_m, pid_n, H, BLOCK_M, BLOCK_N)
    bf16_down_rows(h_ptr, slots, row_mask, down_w, y_ptr, pairs, n_offs, n_mask, I, stride_h,
                   stride_y, BLOCK_K, INTERPRETED)


@triton.jit
def _gate_up_kernel(a_ptr, sorted_pair_ptr, expert_of_block_ptr, gate_w, up_w, h_ptr, num_pairs,
                    a_row_div, H: tl.constexpr, I: tl.constexpr, stride_a, stride_h,
                    stride_expert, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                    ACTIVATION: tl.constexpr = "silu", PDL: tl.constexpr = False):
    """gate_w, up_w: expert e's `[I, H]` row-major block at `e * stride_expert` (I * H for
    stacked `[E, I, H]` weights, 2 * I * H for the halves of a fused `[E, 2I, H]`)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert >= 0:
        offset = expert.to(tl.int64) * stride_expert
        bf16_gate_up_block(a_ptr, sorted_pair_ptr, gate_w + offset, up_w + offset, h_ptr,
                           num_pairs, a_row_div, pid_m, tl.program_id(1), H, I, stride_a,
                           stride_h, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, ACTIVATION)


@triton.jit
def _down_kernel(h_ptr, sorted_pair_ptr, expert_of_block_ptr, down_w, y_ptr, num_pairs,
                 H: tl.constexpr, I: tl.constexpr, stride_h, stride_y, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert >= 0:
        bf16_down_block(h_ptr, sorted_pair_ptr, down_w + expert.to(tl.int64) * H * I, y_ptr,
                        num_pairs, pid_m, tl.program_id(1), H, I, stride_h, stride_y, BLOCK_M,
                        BLOCK_N, BLOCK_K, INTERPRETED)


def _bf16_moe_impl(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                   shared_expert: bool = False, activation: str = "silu") -> torch.Tensor:
    tokens, hidden = x.shape
    shared = int(shared_expert)  # an int: a bool in symbolic-shape arithmetic fails to trace
    pairs_per_token = topk_ids.shape[1] + shared  # the shared expert's pair: column K
    routed_experts, inter = gate_proj.shape[0] - shared, gate_proj.shape[1]
    out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=x.device)
    if tokens == 0:
        return out
    num_pairs = tokens * pairs_per_token
    block_m, sorted_pair, expert_of_block = route_pairs(topk_ids, routed_experts, shared_expert,
                                                        block_m=_BLOCK_M)
    num_blocks = expert_of_block.shape[0]
    n1, k1, w1, s1 = _LAUNCH["gate_up"]
    n2, k2, w2, s2 = _LAUNCH["down"]
    h = torch.empty((num_blocks * block_m, inter), dtype=torch.bfloat16, device=x.device)
    launcher(_gate_up_kernel)[(num_blocks, triton.cdiv(inter, n1))](
        x, sorted_pair, expert_of_block, gate_proj, up_proj, h, num_pairs, pairs_per_token,
        hidden, inter, x.stride(0), h.stride(0), gate_proj.stride(0), BLOCK_M=block_m,
        BLOCK_N=n1, BLOCK_K=k1, INTERPRETED=_INTERPRETED, ACTIVATION=activation, num_warps=w1,
        num_stages=s1)
    y = torch.empty((num_pairs, hidden), dtype=torch.bfloat16, device=x.device)
    launcher(_down_kernel)[(num_blocks, triton.cdiv(hidden, n2))](
        h, sorted_pair, expert_of_block, down_proj, y, num_pairs, hidden, inter, h.stride(0),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=n2, BLOCK_K=k2, INTERPRETED=_INTERPRETED,
        num_warps=w2, num_stages=s2)
    return combine_pairs(y, topk_weights, out, shared_expert)  # [T, H]


def _bf16_moe_fake(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.bfloat16)


_bf16_moe_op = traced_triton_op("dlmc::bf16_moe", _bf16_moe_impl, _bf16_moe_fake)


def bf16_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
             shared_expert: bool = False, activation: str = "silu") -> torch.Tensor:
    """Routed-expert MoE with BF16 experts (Triton, `dlmc::bf16_moe`).

    x bf16 `[T, H]`; topk_ids int32/int64 `[T, K]` in `[0, E)`; topk_weights fp32 `[T, K]`;
    gate_proj, up_proj bf16 `[E, I, H]`, each expert's `[I, H]` block row-major, both with the
    same expert stride: contiguous stacks, or the halves `gate_up_proj[:, :I]`,
    `gate_up_proj[:, I:]` of a contiguous fused `[E, 2I, H]` (read in place); down_proj bf16
    `[E, H, I]` contiguous.
    Returns bf16 `[T, H]` = `sum_k w[t, k] * bf16(down(bf16(act(g)) * u))` summed in fp32, with
    `g`, `u` the bf16-rounded gate and up projections and `act` the `activation`: "silu"
    (SwiGLU, LLaDA2) or "gelu_tanh" (`gelu(approximate="tanh")` in fp32, DiffusionGemma).
    `shared_expert`: expert E-1 is a shared expert that every token also takes with weight 1.0
    (topk_ids then in `[0, E-1)`): the same result as the `[T, K+1]` routing with that column
    appended (`append_shared_column`), without sorting the shared rows. No host sync
    (graph-capturable).
    """
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"bf16_moe: x must be bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    _check_activation(activation)
    _check_weights(x.shape[1], gate_proj, up_proj, down_proj)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"bf16_moe: topk_ids/topk_weights must be [T={x.shape[0]}, K], got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    return _bf16_moe_op(x.contiguous(), topk_ids, topk_weights.float(), gate_proj, up_proj,
                        down_proj, shared_expert, activation)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"bf16_moe: activation={activation!r}, expected one of "
                         f"{', '.join(ACTIVATIONS)}")


def _check_weights(hidden: int, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> None:
    """The layouts `bf16_moe` takes, else a ValueError naming the tensor."""
    for name, w in (("gate_proj", gate_proj), ("up_proj", up_proj)):
        if w.dtype != torch.bfloat16 or w.dim() != 3:
            raise ValueError(f"bf16_moe: {name} must be bf16 [E, I, H={hidden}], got {w.dtype} "
                             f"{tuple(w.shape)}")
    experts, inter = gate_proj.shape[0], gate_proj.shape[1]
    if gate_proj.shape != (experts, inter, hidden) or up_proj.shape != gate_proj.shape:
        raise ValueError(f"bf16_moe: gate_proj and up_proj must both be [E, I, H={hidden}], got "
                         f"{tuple(gate_proj.shape)} / {tuple(up_proj.shape)}")
    for name, w in (("gate_proj", gate_proj), ("up_proj", up_proj)):
        if w.stride(2) != 1 or w.stride(1) != hidden or w.stride(0) < inter * hidden:
            raise ValueError(f"bf16_moe: {name} must have row-major [I, H] expert blocks "
                             f"(strides (>= {inter * hidden}, {hidden}, 1)), got strides "
                             f"{w.stride()}")
    if gate_proj.stride(0) != up_proj.stride(0):
        raise ValueError(f"bf16_moe: gate_proj and up_proj must have the same expert stride, "
                         f"got {gate_proj.stride(0)} / {up_proj.stride(0)}")
    if (down_proj.dtype != torch.bfloat16 or down_proj.shape != (experts, hidden, inter)
            or not down_proj.is_contiguous()):
        raise ValueError(f"bf16_moe: down_proj must be contiguous bf16 [E={experts}, "
                         f"H={hidden}, I={inter}], got {down_proj.dtype} "
                         f"{tuple(down_proj.shape)} strides {down_proj.stride()}")


def bf16_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                       shared_expert: bool = False, activation: str = "silu") -> torch.Tensor:
    """Plain-PyTorch routed MoE: `y_t = sum_k w_tk * down(act(gate(x_t)) * up(x_t))`, `act` the
    `activation` ("silu", or "gelu_tanh": `gelu(approximate="tanh")`).

    x `[T, H]`, topk_ids `[T, K]`, topk_weights `[T, K]` fp32, gate/up `[E, I, H]`,
    down `[E, H, I]`. Expert outputs are in x's dtype, weighted and summed in fp32, cast back.
    `shared_expert`: every token also takes expert E-1 with weight 1.0 (a `[T, K+1]` routing).
    Loops over the experts that received tokens (eager; reads the counts on the host).
    """
    _check_activation(activation)
    act = F.silu if activation == "silu" else lambda g: F.gelu(g, approximate="tanh")
    if shared_expert:
        topk_ids = append_shared_column(topk_ids, gate_proj.shape[0] - 1)  # [T, K+1]
        topk_weights = append_shared_column(topk_weights, 1.0)
    tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # [T*K]
    counts = torch.bincount(flat_ids, minlength=gate_proj.shape[0]).tolist()
    flat_weights = topk_weights.reshape(-1).float()  # [T*K]
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]  # [n]
        start += count
        token_idx = slots // top_k  # [n]
        xe = x[token_idx]  # [n, H]
        hidden = act(xe @ gate_proj[expert].t()) * (xe @ up_proj[expert].t())  # [n, I]
        ye = hidden @ down_proj[expert].t()  # [n, H]
        out.index_add_(0, token_idx, ye.float() * flat_weights[slots, None])
    return out.to(x.dtype)
