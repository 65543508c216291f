"""The two Triton kernels of `dlmc::nvfp4_moe` (gate/up with the gated activation, down), one
program per M-block of sorted (token, expert) pairs and N-tile; the launches and tiles live in
`_nvfp4_moe_launch` and `nvfp4_moe_tiles`, the maths in `nvfp4_moe.nvfp4_moe_reference`.
`VARIANT` (3 or 7) selects the weight decode (`nvfp4_tiles`); `SHARED` runs the BF16 shared
expert in the same launch, as the extra programs after the routing's blocks
(`moe_shared_parts`; the routing's own shared blocks then have nothing to do). `OVERLAP`: the
down programs wait per slot for the gate/up programs whose rows they read (`moe_overlap`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dlmc.custom_ops._pdl import pdl_enter
from dlmc.custom_ops.bf16_moe import activate
from dlmc.custom_ops.moe_align import block_rows
from dlmc.custom_ops.moe_overlap import program, signal, wait
from dlmc.custom_ops.moe_shared_parts import shared_down_part, shared_gate_up_part
from dlmc.custom_ops.nvfp4_bf16x2 import ACC_SCALE
from dlmc.custom_ops.nvfp4_tiles import nvfp4_tile_dot, round_bf16


@triton.jit
def gated(g, u, ACTIVATION: tl.constexpr, INTERPRETED: tl.constexpr):
    """`act(g) * u` in fp32 (`activate`)."""
    return activate(g, ACTIVATION, INTERPRETED) * u


@triton.jit
def _gate_up_kernel(a_ptr, sorted_pair_ptr, expert_of_block_ptr, gate_w, gate_s, up_w, up_s,
                    gate_alpha_ptr, up_alpha_ptr, h_ptr, num_pairs, a_row_div, H: tl.constexpr,
                    I: tl.constexpr, stride_a, stride_h, shared_gate_w, shared_up_w, shared_id,
                    num_blocks, pairs_per_token, count_ptr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                    VARIANT: tl.constexpr, SHARED: tl.constexpr, SHARED_BLOCK_K: tl.constexpr,
                    SHARED_SPLIT: tl.constexpr, OVERLAP: tl.constexpr = False,
                    PDL: tl.constexpr = False, H_EVEN_ODD: tl.constexpr = False,
                    ACTIVATION: tl.constexpr = "silu"):
    """h[slot, n] = act(gate) * up (`ACTIVATION` "silu" or "gelu_tanh", `gated`) for the
    slots of one M-block and one N-tile of I (routed rows: each 128 columns even first, then
    odd, with `H_EVEN_ODD`, BLOCK_N 128, `_nvfp4_down_gluon`). `SHARED`: programs past the
    `num_blocks` routing blocks are the BF16 shared expert's parts (`moe_shared_parts`, h rows
    from `num_blocks * BLOCK_M` on), run first (the rows in reverse order: heavier per byte
    than FP4 blocks, they start first instead of last); blocks of expert `shared_id` exit.
    `OVERLAP`: each program signals its slot in `count_ptr` (a routing block, or `num_blocks` +
    the parts' token chunk) when its rows are stored."""
    pdl_enter(PDL)
    pid_m, pid_n = program(SHARED, OVERLAP)
    if SHARED and pid_m >= num_blocks:
        shared_gate_up_part(a_ptr, shared_gate_w, shared_up_w, h_ptr, pid_m - num_blocks, pid_n,
                            num_pairs, pairs_per_token, a_row_div, num_blocks * BLOCK_M, H, I,
                            stride_a, stride_h, BLOCK_M, BLOCK_N, SHARED_SPLIT, SHARED_BLOCK_K,
                            INTERPRETED)
        if OVERLAP:
            signal(count_ptr, num_blocks + (pid_m - num_blocks) // SHARED_SPLIT)
    else:
        _gate_up_block(a_ptr, sorted_pair_ptr, expert_of_block_ptr, gate_w, gate_s, up_w, up_s,
                       gate_alpha_ptr, up_alpha_ptr, h_ptr, num_pairs, a_row_div, H, I, stride_a,
                       stride_h, shared_id, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED,
                       VARIANT, count_ptr, OVERLAP, H_EVEN_ODD, ACTIVATION)


@triton.jit
def _gate_up_block(a_ptr, sorted_pair_ptr, expert_of_block_ptr, gate_w, gate_s, up_w, up_s,
                   gate_alpha_ptr, up_alpha_ptr, h_ptr, num_pairs, a_row_div, H: tl.constexpr,
                   I: tl.constexpr, stride_a, stride_h, shared_id, pid_m, pid_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERPRETED: tl.constexpr, VARIANT: tl.constexpr, count_ptr,
                   OVERLAP: tl.constexpr, H_EVEN_ODD: tl.constexpr = False,
                   ACTIVATION: tl.constexpr = "silu"):
    """The FP4 gate/up of routing block `pid_m` (nothing for unused and shared blocks)."""
    expert = tl.load(expert_of_block_ptr + pid_m)
    # The block's pairs are loaded next to the expert id, not after it: the A rows (and so the
    # pipeline's first loads) wait for one global load instead of two in a row.
    slots, _, row_mask, a_rows, n_offs, n_mask = block_rows(
        sorted_pair_ptr, num_pairs, a_row_div, pid_m, pid_n, I, BLOCK_M, BLOCK_N)
    if expert >= 0 and expert != shared_id:
        # The compiled decode accumulates w * 2^-7 (ACC_SCALE restores it with the global
        # scale). The global scales are loaded before the K loop: the epilogue waits for nothing.
        acc_scale = ACC_SCALE if not INTERPRETED else 1.0
        alpha_g = tl.load(gate_alpha_ptr + expert) * acc_scale
        alpha_u = tl.load(up_alpha_ptr + expert) * acc_scale
        e64 = expert.to(tl.int64)
        gate_w += e64 * I * (H // 2)
        gate_s += e64 * I * (H // 16)
        up_w += e64 * I * (H // 2)
        up_s += e64 * I * (H // 16)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g, acc_u = nvfp4_tile_dot(acc_g, acc_u, a_ptr, a_rows, row_mask, stride_a, gate_w,
                                      gate_s, up_w, up_s, n_offs, n_mask, H, BLOCK_N, BLOCK_K,
                                      INTERPRETED, True, VARIANT)
        g = acc_g * alpha_g
        u = acc_u * alpha_u
        h = round_bf16(gated(g, u, ACTIVATION, INTERPRETED), INTERPRETED)
        if H_EVEN_ODD:  # the tile (one 128-column step) even columns first, reordered in
            # registers: the stores stay contiguous
            tl.static_assert(BLOCK_N == 128, "H_EVEN_ODD needs 128-column N-tiles")
            h = tl.reshape(tl.permute(tl.reshape(h, (BLOCK_M, 64, 2)), (0, 2, 1)),
                           (BLOCK_M, 128))
        h_ptrs = h_ptr + slots[:, None] * stride_h + n_offs[None, :]
        tl.store(h_ptrs, h, mask=row_mask[:, None] & n_mask[None, :])
        if OVERLAP:
            signal(count_ptr, pid_m)


@triton.jit
def _down_kernel(h_ptr, sorted_pair_ptr, expert_of_block_ptr, down_w, down_s, down_alpha_ptr,
                 y_ptr, num_pairs, H: tl.constexpr, I: tl.constexpr, stride_h, stride_y,
                 shared_down_w, shared_id, num_blocks, pairs_per_token, count_ptr, num_slots,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr, VARIANT: tl.constexpr, SHARED: tl.constexpr,
                 SHARED_BLOCK_K: tl.constexpr, SHARED_SPLIT: tl.constexpr,
                 GATE_UP_TILES: tl.constexpr = 1, GATE_UP_SPLIT: tl.constexpr = 1,
                 OVERLAP: tl.constexpr = False, PDL: tl.constexpr = False,
                 PARTS_ONLY: tl.constexpr = False):
    """y[pair, n] = bf16(alpha * h[slot] @ down[n]^T) for one M-block and one N-tile of H.
    `SHARED`: programs past the `num_blocks` routing blocks are the BF16 shared expert's parts
    (`moe_shared_parts`); blocks of expert `shared_id` exit. `OVERLAP`: no wait for the whole
    gate/up launch (with PDL); each program waits for its slot's `GATE_UP_TILES` gate/up
    programs (parts: times their `GATE_UP_SPLIT`) in `count_ptr` (`moe_overlap`). `PARTS_ONLY`
    (with `SHARED`): the grid is the shared expert's parts alone (the routed blocks run in
    `_nvfp4_down_gluon`)."""
    if OVERLAP:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        pdl_enter(PDL)
    pid_m, pid_n = program(SHARED, OVERLAP)
    if PARTS_ONLY:
        pid_m += num_blocks
    if SHARED and pid_m >= num_blocks:
        if OVERLAP:
            wait(count_ptr, num_slots, num_blocks + (pid_m - num_blocks) // SHARED_SPLIT,
                 GATE_UP_TILES * GATE_UP_SPLIT, tl.cdiv(H, BLOCK_N) * SHARED_SPLIT)
        shared_down_part(h_ptr, shared_down_w, y_ptr, pid_m - num_blocks, pid_n, num_pairs,
                         pairs_per_token, num_blocks * BLOCK_M, H, I, stride_h, stride_y,
                         BLOCK_M, BLOCK_N, SHARED_SPLIT, SHARED_BLOCK_K, INTERPRETED)
    else:
        _down_block(h_ptr, sorted_pair_ptr, expert_of_block_ptr, down_w, down_s, down_alpha_ptr,
                    y_ptr, num_pairs, H, I, stride_h, stride_y, shared_id, pid_m, pid_n,
                    BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, VARIANT, count_ptr, num_slots,
                    GATE_UP_TILES, OVERLAP)


@triton.jit
def _down_block(h_ptr, sorted_pair_ptr, expert_of_block_ptr, down_w, down_s, down_alpha_ptr,
                y_ptr, num_pairs, H: tl.constexpr, I: tl.constexpr, stride_h, stride_y,
                shared_id, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, VARIANT: tl.constexpr,
                count_ptr, num_slots, GATE_UP_TILES: tl.constexpr, OVERLAP: tl.constexpr):
    """The FP4 down projection of routing block `pid_m` (nothing for unused and shared blocks)."""
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert >= 0 and expert != shared_id:
        slots, pairs, row_mask, _, n_offs, n_mask = block_rows(
            sorted_pair_ptr, num_pairs, 1, pid_m, pid_n, H, BLOCK_M, BLOCK_N)
        if OVERLAP:  # the block's h rows: its gate/up programs' stores
            wait(count_ptr, num_slots, pid_m, GATE_UP_TILES, tl.cdiv(H, BLOCK_N))
        acc_scale = ACC_SCALE if not INTERPRETED else 1.0
        alpha = tl.load(down_alpha_ptr + expert) * acc_scale  # before the loop (see gate/up)
        e64 = expert.to(tl.int64)
        down_w += e64 * H * (I // 2)
        down_s += e64 * H * (I // 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # h has a row for every slot (padding rows hold garbage that only reaches their own,
        # unstored output rows), so its loads need no row mask and so no wait for the pairs.
        all_rows = slots >= 0
        acc, _ = nvfp4_tile_dot(acc, acc, h_ptr, slots, all_rows, stride_h, down_w, down_s,
                                down_w, down_s, n_offs, n_mask, I, BLOCK_N, BLOCK_K, INTERPRETED,
                                False, VARIANT)
        y = acc * alpha
        y_ptrs = y_ptr + pairs[:, None].to(tl.int64) * stride_y + n_offs[None, :]
        tl.store(y_ptrs, round_bf16(y, INTERPRETED), mask=row_mask[:, None] & n_mask[None, :])
