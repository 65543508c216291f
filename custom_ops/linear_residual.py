"""`dlmc::linear_residual`: `residual + x @ W^T` for a block of a few bf16 tokens, split-K, with
each column tile's per-row sum of squares for the RMSNorm that follows; one launch.

LLaDA2's attention output projection (o_proj, `[2048, 2048]`) is followed by the residual add
and the post-attention RMSNorm. With `dlmc::split_k_linear` that is two launches: the partials,
then an Inductor kernel that sums them, adds the residual and normalises. Here the programs
`(n_tile, split)` write their fp32 partials `[S, T, N]` as `split_k_linear` does, then take a
ticket from a per-tile counter; the last program of a column tile (whichever split it is) sums
the tile's S partials in a fixed order (s = 0, 1, ...: deterministic), rounds the product to
bf16, adds the residual (rounded to bf16 once more, as `residual + F.linear(x, W)` in bf16),
stores that `h` and the tile's `sum(h^2)` per token, and resets the counter to zero. The
normalisation itself moves into the consumer that reads `h` anyway (`dlmc::norm_router_gemm`
for the MoE router), which finishes the mean from the tiles' sums.

The counters are one int32 buffer per device, zero between launches (each launch leaves them
as it found them); launches on a stream are ordered (PDL waits for the previous kernel before
any counter is touched), so every call shares it. Two launches running at once on one device
(two streams) would race on it: dlmc runs one round at a time per device (one engine thread,
graphs replayed on one stream). The maths is `linear_residual_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import PDL_LAUNCH, device_has_pdl, launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_tiles import round_bf16
from dlmc.custom_ops.router_gemm import check_small_m_operands, split_k_partial
from dlmc.custom_ops.split_k_linear import _CONFIG as _SPLIT_K_CONFIG
from dlmc.custom_ops.split_k_linear import MAX_TOKENS, linear_splits, split_k_linear_reference

__all__ = ["BLOCK_N", "MAX_TOKENS", "linear_residual", "linear_residual_reference",
           "tile_sums_of_squares"]

# `dlmc::split_k_linear`'s launch (tiles, K splits, warps, stages), so the partials are its own;
# BLOCK_N: the columns of a tile, one row of `sumsq` per tile
BLOCK_N, _, _BLOCK_K, _NUM_WARPS, _NUM_STAGES = _SPLIT_K_CONFIG
_TICKETS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def linear_residual_kernel(x_ptr, w_ptr, res_ptr, part_ptr, h_ptr, ss_ptr, ticket_ptr, tokens,
                           stride_x, stride_r, N: tl.constexpr, K: tl.constexpr,
                           K_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (n_tile, split): its partial of the tile; the tile's last program the rest."""
    pdl_enter(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = split_k_partial(x_ptr, w_ptr, tokens, stride_x, t, n, split, N, K, K_PER_SPLIT,
                          BLOCK_T, BLOCK_N, BLOCK_K, INTERPRETED, True)  # split_k_linear's
    mask = (t[:, None] < tokens) & (n[None, :] < N)
    rows = t[:, None].to(tl.int64) * N + n[None, :]
    # every program loads the residual tile (2 KB), so the last one has it before its ticket
    residual = tl.load(res_ptr + t[:, None] * stride_r + n[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(part_ptr + split * tokens * N + rows, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before the ticket releases them
    ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:  # the tile's last program: the other partials are visible
        tl.debug_barrier()
        total = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(part_ptr + s * tokens * N + rows, mask=mask, other=0.0,
                             cache_modifier=".cg")
        product = round_bf16(total, INTERPRETED).to(tl.float32)
        h = round_bf16(residual + product, INTERPRETED)
        tl.store(h_ptr + rows, h, mask=mask)
        hf = h.to(tl.float32)
        tl.store(ss_ptr + tile * tokens + t, tl.sum(hf * hf, axis=1), mask=t < tokens)
        tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """The device's zeroed ticket counters, at least `count` of them (grown, never shrunk)."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        tickets = torch.zeros(max(count, 256), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


def _outputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, features = x.shape[0], weight.shape[0]
    return (x.new_empty((tokens, features)),
            x.new_empty((triton.cdiv(features, BLOCK_N), tokens), dtype=torch.float32))


def _linear_residual_impl(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                          pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    h, sumsq = _outputs(x, weight)
    tokens, (features, inner) = x.shape[0], weight.shape
    if not tokens:
        return h, sumsq
    splits, per_split = linear_splits(inner)
    partial = torch.empty((splits, tokens, features), dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(features, BLOCK_N)
    launch = PDL_LAUNCH if pdl and device_has_pdl(x.device) else {}
    launcher(linear_residual_kernel)[(tiles, splits)](
        x, weight, residual, partial, h, sumsq, _tickets(x.device, tiles), tokens, x.stride(0),
        residual.stride(0), N=features, K=inner, K_PER_SPLIT=per_split, SPLITS=splits,
        BLOCK_T=max(16, triton.next_power_of_2(tokens)), BLOCK_N=BLOCK_N, BLOCK_K=_BLOCK_K,
        INTERPRETED=_INTERPRETED, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **launch)
    return h, sumsq


def _linear_residual_fake(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                          pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, weight)


_linear_residual_op = traced_triton_op("dlmc::linear_residual", _linear_residual_impl,
                                       _linear_residual_fake, opaque=True)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, sumsq)`: `h = residual + F.linear(x, weight)` in bf16 and, per tile of `BLOCK_N`
    columns, `sumsq[tile, t] = sum(h[t, tile's columns]^2)` in fp32 (`dlmc::linear_residual`).

    x bf16 `[T, K]`, T <= 64, unit stride in the last dim; weight bf16 `[N, K]`; residual bf16
    `[T, N]`, unit stride in the last dim. Returns h bf16 `[T, N]` and sumsq fp32
    `[ceil(N / BLOCK_N), T]`. The product is `split_k_linear`'s partials summed in order and
    rounded once; `pdl`: launch with programmatic dependent launch where the GPU has it. Runs
    on CUDA and under `TRITON_INTERPRET=1`; elsewhere `linear_residual_reference`. No host sync.
    """
    check_small_m_operands("linear_residual", x, weight, torch.bfloat16, MAX_TOKENS)
    if (residual.dtype != torch.bfloat16 or residual.shape != (x.shape[0], weight.shape[0])
            or residual.stride(-1) != 1):
        raise ValueError(f"linear_residual: residual must be bf16 [T={x.shape[0]}, "
                         f"N={weight.shape[0]}] with unit stride in the last dim, got "
                         f"{residual.dtype} {tuple(residual.shape)} strides {residual.stride()}")
    if not (x.is_cuda or _INTERPRETED):
        return linear_residual_reference(x, weight, residual)
    return _linear_residual_op(x if x.stride(1) == 1 else x.contiguous(), weight.contiguous(),
                               residual, pdl)


def tile_sums_of_squares(h: torch.Tensor) -> torch.Tensor:
    """`[ceil(N / BLOCK_N), T]` fp32: each column tile's `sum(h^2)` per row of `h [T, N]`."""
    tokens, features = h.shape
    tiles = triton.cdiv(features, BLOCK_N)
    padded = torch.nn.functional.pad(h.float(), (0, tiles * BLOCK_N - features))
    return padded.square().reshape(tokens, tiles, BLOCK_N).sum(-1).t().contiguous()


def linear_residual_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_residual` in torch ops: the split partials summed and rounded, plus the residual
    in bf16, and `tile_sums_of_squares` of that."""
    product = split_k_linear_reference(x, weight).sum(0).to(torch.bfloat16)
    h = residual + product
    return h, tile_sums_of_squares(h)
