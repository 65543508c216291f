"""The body of `dlmc::nvfp4_moe` (`nvfp4_moe`): which kernels run, and their launches.

Per call, from the shapes, the device and `pdl` (design: docs/nvfp4.md §3.2):
- the kernel variant (`effective_variant`): v7 where the shapes take its tiled layout, else v3;
- the routed pairs aligned into blocks of 16-64 slots (`moe_align`), unless the Gluon kernels
  route their items themselves (no alignment launch);
- gate/up, then down: the Triton kernels (`_nvfp4_moe_kernels`), or on sm_90 with PDL for
  16-slot blocks of few pairs per expert (`gluon_fits`) the Gluon kernels
  (`_nvfp4_gate_up_gluon`, `_nvfp4_down_gluon`);
- the BF16 shared expert: extra programs of the Triton launches (`moe_shared_parts`), or for at
  most 32 tokens items of the two Gluon launches (`_nvfp4_shared_items`);
- `moe_overlap`'s per-slot counters and PDL between the launches;
- the combine (`moe_combine`), unless the pair rows are returned.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from dlmc.custom_ops._nvfp4_down_gluon import down_gluon_applies, launch_down_gluon
from dlmc.custom_ops._nvfp4_gate_up_gluon import gate_up_gluon_applies, launch_gate_up_gluon
from dlmc.custom_ops._nvfp4_moe_kernels import _down_kernel, _gate_up_kernel
from dlmc.custom_ops._nvfp4_self_route import self_route_fits
from dlmc.custom_ops._nvfp4_shared_items import shared_items_apply
from dlmc.custom_ops._pdl import INTERPRETED, PDL_LAUNCH, launcher
from dlmc.custom_ops.moe_align import align_pairs_to_blocks, alignment_buffers
from dlmc.custom_ops.moe_combine import combine_pairs
from dlmc.custom_ops.moe_overlap import counters, overlap_active, overlap_pdl
from dlmc.custom_ops.moe_shared_parts import shared_block_k, shared_parts, shared_split
from dlmc.custom_ops.nvfp4_moe_tiles import (
    ACTIVATIONS,
    NVFP4Tiles,
    default_tiles,
    gluon_fits,
)
from dlmc.custom_ops.nvfp4_words import can_pack
from dlmc.quant.nvfp4_format import fake_quantize_activation

__all__ = ["effective_variant", "run_nvfp4_moe"]

def effective_variant(H: int, I: int) -> int:
    """The kernel that runs experts of hidden size H and width I: v7 (`nvfp4_words`' tiled
    words, `nvfp4_scale_codes`' one-byte codes) where both projections take the tiled layout
    (`nvfp4_words.can_pack`), else v3 (ModelOpt's bytes and E4M3 scales)."""
    return 7 if can_pack(I, H) and can_pack(H, I) else 3


def _alphas(scale_2: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    alpha = scale_2.float().reshape(-1)  # [E]
    return alpha if input_scale is None else alpha * input_scale.float().reshape(-1)


class _Plan(NamedTuple):
    """What one call runs (`_plan`)."""

    variant: int  # 3 or 7
    overlap: bool  # `moe_overlap`'s per-slot counters
    launch_pdl: bool  # PDL launches: gate/up, down, and the alignment and combine
    items: bool  # the shared expert as items of the Gluon launches
    in_routing: bool  # the shared expert's pairs in the alignment
    tiles: NVFP4Tiles  # the Triton kernels' tiles (its `block_m`: slots per routing block)
    gluon_down: bool  # the routed down projection in the Gluon kernel
    gluon_gate_up: bool  # the routed gate/up projection in the Gluon kernel
    no_align: bool  # no alignment launch: both Gluon kernels route their items themselves


def _plan(x: torch.Tensor, topk_ids: torch.Tensor, E: int, I: int, has_shared: bool,
          w4a4: bool, pdl: bool, gate_up_w4a4: bool | None = None, activation: str = "silu",
          tiles: NVFP4Tiles | None = None) -> _Plan:
    """`w4a4`: the down projection's input emulated (`gate_up_w4a4`: gate/up's, as `w4a4` if
    None; the wrapper passes both scales or neither). The Gluon gate/up kernel and the shared
    expert's items compute SiLU only: another `activation` runs the Triton gate/up. Given
    `tiles`, the Triton kernels run both projections with them (no Gluon kernel)."""
    T, K = topk_ids.shape
    H = x.shape[1]
    variant = effective_variant(H, I)
    launch_pdl = overlap_pdl(x.device, pdl) and not w4a4
    gluon = tiles is None  # (the Gluon kernels have tiles of their own)
    gluon_gate_up = gluon and activation == "silu" and gate_up_gluon_applies(I, E)
    # whether the routed experts alone (no shared expert in the routing) take the Gluon
    # kernels without an alignment: the gate/up programs route themselves, launched first
    routed_tiles = default_tiles(T, K, E, H, I, variant)
    routed_alone = (gluon_gate_up and launch_pdl and gluon_fits(T, K, E)
                    and down_gluon_applies(x.device, variant, routed_tiles.block_m)
                    and self_route_fits(T * K, E))
    gate_up_w4a4 = w4a4 if gate_up_w4a4 is None else gate_up_w4a4
    items = has_shared and not gate_up_w4a4 and shared_items_apply(T, H, I) and routed_alone
    in_routing = has_shared and not items
    tiles = tiles or (default_tiles(T, K, E, H, I, variant, True) if in_routing
                      else routed_tiles)
    tiles.check_shape(variant)
    gluon_down = (gluon and launch_pdl and gluon_fits(T, K, E, in_routing)
                  and down_gluon_applies(x.device, variant, tiles.block_m))
    return _Plan(variant, overlap_active(x.device, pdl) and not w4a4, launch_pdl, items,
                 in_routing, tiles, gluon_down, gluon_down and not in_routing and gluon_gate_up,
                 routed_alone and not in_routing)


def run_nvfp4_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    gate_weight: torch.Tensor, gate_weight_scale: torch.Tensor, gate_weight_scale_2: torch.Tensor,
    up_weight: torch.Tensor, up_weight_scale: torch.Tensor, up_weight_scale_2: torch.Tensor,
    down_weight: torch.Tensor, down_weight_scale: torch.Tensor, down_weight_scale_2: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None, pairs: bool = False, pdl: bool = True,
    activation: str = "silu", tiles: list[int] | None = None,
) -> torch.Tensor:
    """Body of `dlmc::nvfp4_moe`. Same tensors as `nvfp4_moe.nvfp4_moe`, except that the
    weights and block scales are the operands kernel `effective_variant` reads (uint8 bytes,
    `nvfp4_words.projection_operands`) and the W4A4 activation scales come pre-combined:
    `gate_up_input_scale` fp32 `[E]` (shared by gate and up) and `down_input_scale` fp32 `[E]`
    (None: no emulation). `shared_*` (all three or none): the BF16 shared expert. `pairs`:
    return the pair rows `[T*P, H]` uncombined. `pdl`, `activation`: as `nvfp4_moe`'s.
    `tiles`: `NVFP4Tiles.as_list()` (None: `default_tiles`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"nvfp4_moe: activation={activation!r}, expected one of {ACTIVATIONS}")
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = gate_weight.shape[0], gate_weight.shape[1]
    has_shared = shared_gate is not None and shared_up is not None and shared_down is not None
    shared = int(has_shared)  # an int: a bool in symbolic-shape arithmetic fails to trace
    pairs_per_token = K + shared  # the shared expert's pair of token t: t*(K+1) + K
    out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return out  # ([0, H] whether combined or not)
    num_pairs = T * pairs_per_token
    plan = _plan(x, topk_ids, E, I, has_shared, down_input_scale is not None, pdl,
                 gate_up_input_scale is not None, activation,
                 None if tiles is None else NVFP4Tiles.from_list(tiles))
    variant, items, chosen = plan.variant, plan.items, plan.tiles
    block_m = chosen.block_m
    a, a_row_div = x.contiguous(), pairs_per_token
    if gate_up_input_scale is not None:  # W4A4 emulation: quantize each routed pair's row
        pair_expert = topk_ids.reshape(-1).long()  # [T*K]
        a = fake_quantize_activation(x.repeat_interleave(K, dim=0),
                                     gate_up_input_scale.float()[pair_expert])  # [T*K, H]
        if has_shared:  # the shared expert (BF16) reads x as is: rows t*(K+1) + K
            a = torch.cat([a.view(T, K, H), x[:, None]], dim=1).reshape(num_pairs, H)
        a_row_div = 1
    # the Gluon launches, with the shared expert as items: the routed pairs as if alone
    routed_pairs, routed_div = (T * K, K) if items else (num_pairs, a_row_div)
    g_w, u_w, d_w = (shared_gate, shared_up, shared_down) if has_shared else (x, x, x)
    block_n1, block_k1 = chosen.gate_up_block_n, chosen.gate_up_block_k
    parts1 = shared_parts(T, block_m, block_n1) if has_shared else 0
    if plan.no_align:  # the buffers give the Gluon kernels their shapes; gate/up fills them
        sorted_pair, expert_of_block = alignment_buffers(topk_ids, E, block_m)
    else:
        sorted_pair, expert_of_block = align_pairs_to_blocks(topk_ids, E, block_m,
                                                             plan.in_routing, plan.launch_pdl)
    num_blocks = expert_of_block.shape[0]
    # h: a row per routing slot, then (shared expert) a row per token (`moe_shared_parts`).
    routed_rows = num_blocks * block_m
    h = torch.empty((routed_rows + shared * -(-T // block_m) * block_m, I), dtype=torch.bfloat16,
                    device=x.device)
    num_slots = num_blocks + shared * -(-T // block_m)
    # (unread without overlap; the Gluon down kernel's ticket counter: one more slot's room)
    count = (counters(x.device, num_slots + int(plan.gluon_down)) if plan.overlap
             else expert_of_block)
    pdl_launch = PDL_LAUNCH if plan.launch_pdl else {"PDL": False}
    tiles1 = triton.cdiv(I, block_n1)
    rows1 = 0 if plan.gluon_gate_up else num_blocks + parts1
    gate_alpha = _alphas(gate_weight_scale_2, gate_up_input_scale)
    up_alpha = _alphas(up_weight_scale_2, gate_up_input_scale)
    y = torch.empty((num_pairs, H), dtype=torch.bfloat16, device=x.device)
    block_n2, block_k2 = chosen.down_block_n, chosen.down_block_k
    parts2 = shared_parts(T, block_m, block_n2) if has_shared else 0
    tiles2 = triton.cdiv(H, block_n2)
    if rows1:  # `moe_overlap`: slot-major grids, N-tiles fastest
        launcher(_gate_up_kernel)[(tiles1, rows1) if plan.overlap else (rows1, tiles1)](
            a, sorted_pair, expert_of_block, gate_weight, gate_weight_scale,
            up_weight, up_weight_scale, gate_alpha, up_alpha, h, num_pairs, a_row_div, H, I,
            a.stride(0), h.stride(0), g_w, u_w, E, num_blocks, pairs_per_token, count,
            BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=block_k1, INTERPRETED=INTERPRETED,
            VARIANT=variant, SHARED=has_shared, SHARED_BLOCK_K=shared_block_k(H),
            SHARED_SPLIT=shared_split(block_n1), OVERLAP=plan.overlap,
            H_EVEN_ODD=plan.gluon_down, ACTIVATION=activation, num_warps=chosen.gate_up_warps,
            num_stages=chosen.num_stages, **pdl_launch,
        )
    if down_input_scale is not None:  # the routed rows; the shared expert's (after) stay bf16
        slot_expert = expert_of_block.long().clamp(0, E - 1).repeat_interleave(block_m)  # [S]
        quantized = fake_quantize_activation(h[:routed_rows],
                                             down_input_scale.float()[slot_expert])
        h = torch.cat([quantized, h[routed_rows:]]) if has_shared else quantized
    # the routed blocks in the Gluon kernel: the Triton launch runs the shared parts alone
    rows2 = 0 if items else parts2 if plan.gluon_down else num_blocks + parts2
    down_alpha = _alphas(down_weight_scale_2, down_input_scale)
    if rows2:  # with the Gluon kernel, before it (it waits for this launch at its end)
        launcher(_down_kernel)[(tiles2, rows2) if plan.overlap else (rows2, tiles2)](
            h, sorted_pair, expert_of_block, down_weight, down_weight_scale, down_alpha, y,
            num_pairs, H, I, h.stride(0), y.stride(0), d_w, E, num_blocks, pairs_per_token,
            count, num_slots, BLOCK_M=block_m,
            BLOCK_N=block_n2, BLOCK_K=block_k2, INTERPRETED=INTERPRETED, VARIANT=variant,
            SHARED=has_shared, SHARED_BLOCK_K=shared_block_k(I),
            SHARED_SPLIT=shared_split(block_n2), GATE_UP_TILES=tiles1,
            GATE_UP_SPLIT=shared_split(block_n1), OVERLAP=plan.overlap,
            PARTS_ONLY=plan.gluon_down, num_warps=chosen.down_warps,
            num_stages=chosen.num_stages, **pdl_launch,
        )
    if plan.gluon_gate_up:  # right after the alignment, or first (no alignment)
        launch_gate_up_gluon(
            a, sorted_pair, expert_of_block,
            (gate_weight, gate_weight_scale, up_weight, up_weight_scale), (gate_alpha, up_alpha),
            h, count, routed_pairs, E, routed_div,
            topk_ids=topk_ids if plan.no_align else None,
            shared_items=(g_w, u_w, routed_rows, num_blocks) if items else None)
    if plan.gluon_down:  # (writers: gate/up's programs per block, or its items per 8-slot part)
        launch_down_gluon(h, sorted_pair, expert_of_block, down_weight, down_weight_scale,
                          down_alpha, y, routed_pairs, E, count, num_slots, tiles1,
                          per_part=plan.gluon_gate_up,
                          topk_ids=topk_ids if plan.no_align else None,
                          **({"pair_gap": K, "shared_items": (d_w, routed_rows, num_blocks, T)}
                             if items else {}))
    if pairs:
        return y  # [T*P, H]
    return combine_pairs(y, topk_weights, out, has_shared, plan.launch_pdl)  # [T, H]
