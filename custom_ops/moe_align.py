"""`dlmc::moe_align`: routing prep for the grouped MoE kernels, one Triton launch.

(token, k) pairs are grouped per expert and each expert's segment is padded to `block_m` slots
(the vLLM `moe_align_block_size` pattern). Up to `PER_EXPERT_PAIRS` pairs one program sorts the
pair keys `expert * P_PAD + pair` (stable by construction), counts the pairs per expert, fills
every slot with padding and every block with -1 in whole lines, then (after a barrier) scatters
every pair and every used block's expert over them. More pairs (DiffusionGemma's 256-token
canvas: 2048) take one program per expert instead (`align_pairs_of_expert`): each counts all
pairs, ranks its own by a prefix sum in pair order and writes its own blocks, and one more
program writes the blocks after the used ones; a sort of thousands of keys in one program costs
more than the whole grid. Both: static shapes, no host sync, CUDA-graph capturable. The
maths is `align_pairs_to_blocks_reference` (torch ops only), which also serves CPU runs without
Triton's interpreter.

A shared expert that every token takes (`shared_expert=True`) is a dense tail: its `T` rows are
written in token order into `ceil(T / block_m)` blocks after the routed experts' blocks, unsorted,
so the sort and the per-expert tiles stay at the routed `T*K` pairs and `E` experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import PDL_LAUNCH, launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op

__all__ = ["PairRouting", "aligned_blocks", "alignment_buffers", "align_pairs_to_blocks",
           "align_pairs_to_blocks_reference", "append_shared_column", "block_rows",
           "moe_block_size", "route_block_m", "route_pairs"]

# One program holds all pair keys and per-expert counts in registers; larger routings take the
# torch path.
MAX_KERNEL_PAIRS = 8192
MAX_KERNEL_EXPERTS = 512
# Above this many pairs, one program per expert (`align_pairs_of_expert`) instead of one sort.
PER_EXPERT_PAIRS = 1024


def moe_block_size(num_pairs: int, num_experts: int) -> int:
    """Rows per M-block: 16 (the MMA minimum) for few tokens per expert, up to 64."""
    per_expert = num_pairs // max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static block count: every expert may leave one partly filled block."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def aligned_blocks(tokens: int, top_k: int, num_experts: int, block_m: int,
                   shared_expert: bool = False) -> int:
    """Static block count of `align_pairs_to_blocks`: the routed pairs' `max_blocks`, plus
    `ceil(tokens / block_m)` for the shared expert's rows."""
    shared_blocks = -(-tokens // block_m) if shared_expert else 0
    return max_blocks(tokens * top_k, num_experts, block_m) + shared_blocks


def append_shared_column(routing: torch.Tensor, value: float) -> torch.Tensor:
    """`[T, K]` ids or weights -> `[T, K+1]` with `value` (the shared expert's id, or 1.0) last."""
    return torch.cat([routing, routing.new_full((routing.shape[0], 1), value)], dim=1)


@triton.jit
def _axis_indicator(LOG_N: tl.constexpr, axis: tl.constexpr):
    """0/1 along hypercube axis `axis` (counted from the innermost), shaped for `[2] * LOG_N`."""
    return tl.reshape(tl.arange(0, 2), [1] * (LOG_N - axis - 1) + [2] + [1] * axis)


@triton.jit
def _sort_ascending(x, LOG_N: tl.constexpr):
    """Bitonic sort of the distinct non-negative int32 keys `x [2**LOG_N]`.

    `tl.sort` with the partner found by `tl.sum` (exact: keys below 2**22) rather than
    `tl.xor_sum`, which Triton's interpreter runs element by element.
    """
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_N + 1):
        flip = _axis_indicator(LOG_N, stage) if stage < LOG_N else 0
        for i in tl.static_range(stage):
            partner = tl.sum(h, LOG_N - stage + i, keep_dims=True) - h  # swap along one axis
            is_right = _axis_indicator(LOG_N, stage - 1 - i)
            h = tl.where((h > partner) != (flip ^ is_right), partner, h)
    return tl.reshape(h, [2**LOG_N])


@triton.jit
def align_pairs(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_pairs, top_k, shared_expert,
                NUM_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, LOG_PAIRS_PAD: tl.constexpr,
                EXPERTS_PAD: tl.constexpr, SHARED_BLOCKS: tl.constexpr, FILL: tl.constexpr):
    """`num_pairs = T*K` routed pairs; with `SHARED_BLOCKS > 0` pair ids count `K+1` per token
    and expert `shared_expert` takes every token's column K in the blocks after the routed ones.
    The body of `moe_align_kernel` (and of the fused routing kernels that align)."""
    PAIRS_PAD: tl.constexpr = 2**LOG_PAIRS_PAD
    pair = tl.arange(0, PAIRS_PAD)
    is_pair = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=is_pair, other=0).to(tl.int32)  # [P]
    counts = tl.histogram(expert, EXPERTS_PAD, mask=is_pair)  # [E]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    block_end = tl.cumsum(blocks, 0)  # [E]
    block_start = block_end - blocks
    seg_start = tl.cumsum(counts, 0) - counts  # [E]
    # Sorted keys: pairs grouped by expert, in pair order inside each expert; padding sorts last.
    key = tl.where(is_pair, expert, EXPERTS_PAD) * PAIRS_PAD + pair
    key = _sort_ascending(key, LOG_PAIRS_PAD)  # [P]
    s_pair = key % PAIRS_PAD
    pad = num_pairs  # the pair id of padding slots: the pair count
    if SHARED_BLOCKS > 0:  # ids of the [T, K+1] routing: routed pair t*K + k is t*(K+1) + k
        pad = num_pairs + num_pairs // top_k
        s_pair = s_pair + s_pair // top_k
    s_expert = tl.minimum(key // PAIRS_PAD, EXPERTS_PAD - 1)
    rank = pair - tl.gather(seg_start, s_expert, 0)  # [P] position inside the expert's segment
    slot = tl.gather(block_start, s_expert, 0) * BLOCK_M + rank
    # Every slot padding and every block unused first (whole lines: per-expert masks cost about
    # a third of the kernel), then, after a barrier, the pairs, the blocks' experts and the
    # shared expert's rows over them.
    fill = tl.arange(0, FILL)
    for start in range(0, NUM_BLOCKS * BLOCK_M, FILL):
        tl.store(sorted_pair_ptr + start + fill, pad, mask=start + fill < NUM_BLOCKS * BLOCK_M)
    for start in range(0, NUM_BLOCKS, FILL):
        tl.store(expert_of_block_ptr + start + fill, -1, mask=start + fill < NUM_BLOCKS)
    tl.debug_barrier()  # (the program's own stores to the same slots: these come after)
    tl.store(sorted_pair_ptr + slot, s_pair, mask=is_pair)
    tl.store(expert_of_block_ptr + slot // BLOCK_M, s_expert,
             mask=is_pair & (rank % BLOCK_M == 0))
    if SHARED_BLOCKS > 0:  # after the routed blocks: the shared expert's rows t*(K+1) + K in
        # token order (every token takes it: no sort)
        used = tl.sum(blocks, 0)
        for start in range(0, SHARED_BLOCKS * BLOCK_M, FILL):
            row = start + fill
            tl.store(sorted_pair_ptr + used * BLOCK_M + row, row * (top_k + 1) + top_k,
                     mask=row < num_pairs // top_k)
        for start in range(0, SHARED_BLOCKS, FILL):
            b = start + fill
            tl.store(expert_of_block_ptr + used + b, shared_expert, mask=b < SHARED_BLOCKS)


@triton.jit
def moe_align_kernel(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_pairs, top_k,
                     shared_expert, NUM_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                     LOG_PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                     SHARED_BLOCKS: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    align_pairs(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_pairs, top_k, shared_expert,
                NUM_BLOCKS, BLOCK_M, LOG_PAIRS_PAD, EXPERTS_PAD, SHARED_BLOCKS, FILL)


@triton.jit
def align_pairs_of_expert(ids_ptr, sorted_pair_ptr, expert_of_block_ptr, num_pairs, top_k,
                          num_experts, NUM_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                          LOG_PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                          SHARED_BLOCKS: tl.constexpr, FILL: tl.constexpr,
                          PDL: tl.constexpr = False):
    """`align_pairs`' layout from `num_experts + 1` programs. Program `e < num_experts` writes
    expert e's blocks: its pairs in pair order (rank: a prefix sum of `expert == e`), padding up
    to its last block's end, its id per block. The last program writes every block after the
    used ones: the shared expert's `SHARED_BLOCKS` (id `num_experts`) and then unused ones (-1)."""
    pdl_enter(PDL)
    PAIRS_PAD: tl.constexpr = 2**LOG_PAIRS_PAD
    e = tl.program_id(0)
    pair = tl.arange(0, PAIRS_PAD)
    is_pair = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=is_pair, other=0).to(tl.int32)  # [P]
    blocks = (tl.histogram(expert, EXPERTS_PAD, mask=is_pair) + BLOCK_M - 1) // BLOCK_M  # [E]
    pad = num_pairs  # the pair id of padding slots
    if SHARED_BLOCKS > 0:  # pair ids of the [T, K+1] routing
        pad = num_pairs + num_pairs // top_k
    fill = tl.arange(0, FILL)
    if e < num_experts:
        first = tl.sum(tl.where(tl.arange(0, EXPERTS_PAD) < e, blocks, 0), 0)  # its first block
        mine = is_pair & (expert == e)
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # [P]
        s_pair = pair
        if SHARED_BLOCKS > 0:
            s_pair = pair + pair // top_k
        tl.store(sorted_pair_ptr + first * BLOCK_M + rank, s_pair, mask=mine)
        count = tl.sum(mine.to(tl.int32), 0)
        used = (count + BLOCK_M - 1) // BLOCK_M
        tail = count + tl.arange(0, BLOCK_M)  # the last block's padding slots
        tl.store(sorted_pair_ptr + first * BLOCK_M + tail, pad, mask=tail < used * BLOCK_M)
        for start in range(0, NUM_BLOCKS, FILL):  # (static bounds: whole lines, masked)
            tl.store(expert_of_block_ptr + first + start + fill, e, mask=start + fill < used)
    else:
        used = tl.sum(blocks, 0)  # the routed experts' blocks
        for start in range(0, NUM_BLOCKS * BLOCK_M, FILL):
            row = start + fill - used * BLOCK_M  # slots after the routed blocks: row >= 0
            value = tl.full([FILL], pad, tl.int32)
            if SHARED_BLOCKS > 0:  # the shared expert's rows t*(K+1) + K in token order
                value = tl.where(row < num_pairs // top_k, row * (top_k + 1) + top_k, value)
            tl.store(sorted_pair_ptr + start + fill, value,
                     mask=(row >= 0) & (start + fill < NUM_BLOCKS * BLOCK_M))
        for start in range(0, NUM_BLOCKS, FILL):
            b = start + fill - used
            value = tl.where(b < SHARED_BLOCKS, num_experts, -1)
            tl.store(expert_of_block_ptr + start + fill, value,
                     mask=(b >= 0) & (start + fill < NUM_BLOCKS))


def _moe_align_impl(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _align(topk_ids, num_experts, block_m, shared_expert, {})


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int, shared_expert: bool,
           launch: dict[str, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body; `launch`: extra launch options (`_pdl.PDL_LAUNCH` or none)."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    sorted_pair, expert_of_block = alignment_buffers(topk_ids, num_experts, block_m,
                                                     shared_expert)
    if num_pairs == 0:
        return sorted_pair, expert_of_block
    kernel, programs, constants, num_warps = align_launch(tokens, top_k, num_experts, block_m,
                                                          shared_expert)
    launcher(kernel)[(programs,)](
        topk_ids.reshape(-1), sorted_pair, expert_of_block, num_pairs, top_k, num_experts,
        **constants, num_warps=num_warps, **launch)
    return sorted_pair, expert_of_block


def alignment_buffers(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                      shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized `(sorted_pair, expert_of_block)` of `align_pairs_to_blocks`' shapes (what
    `nvfp4_moe` hands its kernels when they route themselves)."""
    num_blocks = aligned_blocks(*topk_ids.shape, num_experts, block_m, shared_expert)
    return (torch.empty(num_blocks * block_m, dtype=torch.int32, device=topk_ids.device),
            torch.empty(num_blocks, dtype=torch.int32, device=topk_ids.device))


def align_launch(tokens: int, top_k: int, num_experts: int, block_m: int, shared_expert: bool
                 ) -> tuple[triton.JITFunction, int, dict[str, int], int]:
    """(kernel, programs, constexprs, num_warps) for `T*K` routed pairs (at least one): one
    sorting program (`moe_align_kernel`) up to `PER_EXPERT_PAIRS` pairs, else one program per
    expert and one more (`align_pairs_of_expert`)."""
    num_pairs = tokens * top_k
    num_blocks = aligned_blocks(tokens, top_k, num_experts, block_m, shared_expert)
    pairs_pad = max(16, triton.next_power_of_2(num_pairs))
    experts_pad = max(16, triton.next_power_of_2(num_experts))
    work = max(pairs_pad, experts_pad * block_m // 8)  # register tiles [P] and [E, BM]
    constants = {"NUM_BLOCKS": num_blocks, "BLOCK_M": block_m,
                 "LOG_PAIRS_PAD": pairs_pad.bit_length() - 1, "EXPERTS_PAD": experts_pad,
                 "SHARED_BLOCKS": num_blocks - max_blocks(num_pairs, num_experts, block_m),
                 "FILL": 1024}
    if num_pairs > PER_EXPERT_PAIRS:
        return align_pairs_of_expert, num_experts + 1, constants, 4 if num_pairs <= 4096 else 8
    return moe_align_kernel, 1, constants, 4 if work <= 512 else 8 if work <= 2048 else 16


def _moe_align_fake(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = aligned_blocks(*topk_ids.shape, num_experts, block_m, shared_expert)
    return (topk_ids.new_empty(num_blocks * block_m, dtype=torch.int32),
            topk_ids.new_empty(num_blocks, dtype=torch.int32))


# Inductor traces through the body (two allocations + the kernel); opaque when interpreted.
_moe_align_op = traced_triton_op("dlmc::moe_align", _moe_align_impl, _moe_align_fake)


def _kernel_applies(topk_ids: torch.Tensor, num_experts: int) -> bool:
    return ((topk_ids.is_cuda or _INTERPRETED) and topk_ids.numel() <= MAX_KERNEL_PAIRS
            and num_experts <= MAX_KERNEL_EXPERTS)


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, shared_expert: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs per expert, each expert's segment padded to `block_m` slots.

    topk_ids int32/int64 `[T, K]` (K >= 1) in `[0, num_experts)`; block_m a power of two. Returns
    `sorted_pair` int32 `[B * block_m]` (pair id `t*K + k` in pair order inside each expert's
    segment, experts ascending, `T*K` for padding) and `expert_of_block` int32 `[B]` (-1 for
    unused blocks, which come last), with `B = aligned_blocks(T, K, num_experts, block_m)`.
    `shared_expert`: every token also takes expert `num_experts` (the shared expert). The result
    is then that of the `[T, K+1]` routing `append_shared_column(topk_ids, num_experts)` (pair
    ids `t*(K+1) + k`, `T*(K+1)` for padding; the shared expert's `ceil(T / block_m)` blocks
    right after the routed ones) in `B = aligned_blocks(..., shared_expert=True)` blocks.
    One Triton program (`dlmc::moe_align`) on CUDA and under `TRITON_INTERPRET=1`, the torch
    reference otherwise. `pdl` (the body of an opaque op on sm_90+ only, `_pdl.launcher`):
    the kernel launches with programmatic dependent launch.
    """
    if _kernel_applies(topk_ids, num_experts):
        if pdl and not _INTERPRETED:
            return _align(topk_ids.contiguous(), num_experts, block_m, shared_expert,
                          PDL_LAUNCH)
        # The registered op, never its body: Dynamo cannot trace `_pdl.launcher` itself
        # (`hasattr` on a Triton kernel), and eager launches are direct only inside an op.
        return _moe_align_op(topk_ids.contiguous(), num_experts, block_m, shared_expert)
    return align_pairs_to_blocks_reference(topk_ids, num_experts, block_m, shared_expert)


def align_pairs_to_blocks_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, shared_expert: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs_to_blocks` in torch ops only (static shapes, no host sync)."""
    tokens, top_k = topk_ids.shape
    num_blocks = aligned_blocks(tokens, top_k, num_experts, block_m, shared_expert)
    if shared_expert:  # the [T, K+1] routing over E+1 experts
        topk_ids, num_experts = append_shared_column(topk_ids, num_experts), num_experts + 1
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    block_start = block_end - blocks
    seg_start = torch.cumsum(counts, 0) - counts  # [E]
    block = torch.arange(num_blocks, device=flat.device)  # [B]
    expert = torch.searchsorted(block_end, block, right=True)  # [B], E when unused
    used = expert < num_experts
    expert_c = expert.clamp(max=num_experts - 1)
    row = (block - block_start[expert_c])[:, None] * block_m + torch.arange(
        block_m, device=flat.device)  # [B, BM] position inside the expert's segment
    valid = used[:, None] & (row < counts[expert_c][:, None])  # [B, BM]
    src = (seg_start[expert_c][:, None] + row).clamp(max=num_pairs - 1)  # [B, BM]
    sorted_pair = torch.where(valid, order[src], num_pairs).to(torch.int32).reshape(-1)
    expert_of_block = torch.where(used, expert, -1).to(torch.int32)  # [B]
    return sorted_pair, expert_of_block


@triton.jit
def block_rows(sorted_pair_ptr, num_pairs, a_row_div, pid_m, pid_n, N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What a grouped-MoE program of M-block `pid_m` and N-tile `pid_n` works on: its `slots`
    `[BM]`, their `pairs` (padding: >= num_pairs), `row_mask`, input rows `pairs // a_row_div`
    (0 for padding), output columns `n_offs` `[BN]` and `n_mask` (< N)."""
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ptr + slots)  # [BM]
    row_mask = pairs < num_pairs
    a_rows = tl.where(row_mask, pairs // a_row_div, 0)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return slots, pairs, row_mask, a_rows, n_offs, n_offs < N


class PairRouting(NamedTuple):
    """What the grouped MoE kernels read: `align_pairs_to_blocks`' result for `block_m`."""

    block_m: int
    sorted_pair: torch.Tensor  # int32 [B * block_m]
    expert_of_block: torch.Tensor  # int32 [B]


def check_pair_routing(op: str, routing: PairRouting) -> None:
    """A handed-over `PairRouting` has the layout of `align_pairs_to_blocks` (shapes and dtypes
    only: its values are not read, no host sync); errors name `op`."""
    block_m, sorted_pair, expert_of_block = routing
    if (block_m < 16 or block_m & (block_m - 1) or sorted_pair.dtype != torch.int32
            or expert_of_block.dtype != torch.int32 or expert_of_block.dim() != 1
            or sorted_pair.shape != (expert_of_block.shape[0] * block_m,)):
        raise ValueError(f"{op}: routing must be (block_m: a power of two >= 16, sorted_pair "
                         "int32 [B * block_m], expert_of_block int32 [B]), got "
                         f"({block_m}, {sorted_pair.dtype} {tuple(sorted_pair.shape)}, "
                         f"{expert_of_block.dtype} {tuple(expert_of_block.shape)})")


def route_block_m(tokens: int, top_k: int, num_experts: int, shared_expert: bool = False) -> int:
    """`route_pairs`' block_m: from all `T*(K+1)` pairs and `E+1` experts with a shared expert."""
    shared = int(shared_expert)  # an int: a bool in symbolic-shape arithmetic fails to trace
    return moe_block_size(tokens * (top_k + shared), num_experts + shared)


def route_pairs(topk_ids: torch.Tensor, num_experts: int,
                shared_expert: bool = False, pdl: bool = False,
                block_m: int | None = None) -> PairRouting:
    """`(block_m, sorted_pair, expert_of_block)` for the grouped MoE kernels (see above), block_m
    from `route_block_m` unless given (16, 32 or 64); `pdl` as in `align_pairs_to_blocks`."""
    if block_m is None:
        block_m = route_block_m(*topk_ids.shape, num_experts, shared_expert)
    elif block_m not in (16, 32, 64):
        raise ValueError(f"route_pairs: block_m must be 16, 32 or 64, got {block_m!r}")
    return PairRouting(block_m, *align_pairs_to_blocks(topk_ids, num_experts, block_m,
                                                       shared_expert, pdl))

