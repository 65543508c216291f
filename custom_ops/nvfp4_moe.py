"""`dlmc::nvfp4_moe`: routed-expert MoE over NVFP4 (ModelOpt) expert weights, W4A16 on Hopper.

Each (token, k) pair is sent to expert `topk_ids[t, k]`; the expert computes
`down(silu(gate(x)) * up(x))` with weights dequantized exactly in registers (E2M1 x FP8 block scale
-> BF16, BF16 MMA, fp32 accumulation, the global scales applied per output row in the epilogue), and
the bf16 expert outputs are combined in fp32: `out[t] = sum_k topk_weights[t, k] * y[t, k]`
(`moe_combine.combine_pairs`).
Design in docs/nvfp4.md §3.2; the maths is defined by `nvfp4_moe_reference`. The Triton kernels
are in `_nvfp4_moe_kernels`, the argument checks in `nvfp4_moe_checks`; the weight decodes and
tile loops in `nvfp4_tiles`; the load-time layout of kernel v7 in `nvfp4_words` and
`nvfp4_scale_codes`.
"""

from __future__ import annotations

import inspect

import torch
import triton

from dlmc.custom_ops import _nvfp4_down_self_route
from dlmc.custom_ops._nvfp4_down_gluon import (
    down_gluon_applies,
    down_tickets,
    launch_down_gluon,
    shared_down_in_gate_up,
)
from dlmc.custom_ops._nvfp4_moe_gluon import (
    fused_applies,
    gate_up_applies,
    launch_moe_gluon,
    self_routes,
)
from dlmc.custom_ops._nvfp4_moe_kernels import _down_kernel, _gate_up_kernel
from dlmc.custom_ops._nvfp4_shared_items import shared_items_apply
from dlmc.custom_ops._pdl import PDL_LAUNCH, launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.moe_align import (
    PairRouting,
    alignment_buffers,
    check_pair_routing,
    route_block_m,
    route_pairs,
)
from dlmc.custom_ops.moe_combine import combine_pairs
from dlmc.custom_ops.moe_overlap import (
    OPAQUE_OP,
    counters,
    edge_pdl,
    overlap_active,
    overlap_pdl,
)
from dlmc.custom_ops.moe_shared_parts import shared_block_k, shared_parts, shared_split
from dlmc.custom_ops.nvfp4_moe_checks import check_arguments, check_shared_expert
from dlmc.custom_ops.nvfp4_words import (
    can_pack,
    e4m3_scales,
    projection_operands,
    weight_operand,
)
from dlmc.quant.nvfp4_format import dequantize_blocks, fake_quantize_activation

__all__ = ["nvfp4_moe", "nvfp4_moe_reference"]



def effective_variant(H: int, I: int) -> int:
    """The kernel that runs experts of hidden size H and width I: v7 (`nvfp4_words`' tiled
    words, `nvfp4_scale_codes`' one-byte codes) where both projections take the tiled layout
    (`nvfp4_words.can_pack`), else v3 (ModelOpt's bytes and E4M3 scales)."""
    return 7 if can_pack(I, H) and can_pack(H, I) else 3


# Launch-config override for tuning sweeps (perf/bench_nvfp4_moe.py --tiles):
# (BLOCK_N, BLOCK_K, num_warps, num_stages), or None for the defaults below.
# A fifth entry, if given, is ptxas's register cap per thread (`maxnreg`).
_TILE: tuple[int, ...] | None = None
_TILE_KERNEL = "both"  # which kernel the override applies to: "gate_up", "down" or "both"


def _block_n(dim: int, widest: int) -> int:
    """N-tile width: `widest`, narrower for small dims."""
    return next((b for b in (128, 64, 32) if b <= widest and dim >= b), 16)


# Widest N-tile of each kernel, by variant (v7's gate/up: one 128-row run of its layout)
_GATE_UP_BLOCK_N = {3: 64, 7: 128}
_DOWN_BLOCK_N = {3: 128, 7: 128}


def _launch_config(n: int, k: int, widest: int,
                   kernel: str) -> tuple[int, int, dict[str, int]]:
    """(BLOCK_N, BLOCK_K, launch kwargs) for an output width `n` and reduction length `k`."""
    if _TILE is None or _INTERPRETED or _TILE_KERNEL not in ("both", kernel):
        return _block_n(n, widest), 128 if k >= 128 else 32, {}
    block_n, block_k, num_warps, num_stages = _TILE[:4]
    while block_n > 16 and block_n > n:
        block_n //= 2
    while block_k > 32 and block_k > k:
        block_k //= 2
    launch = {"num_warps": num_warps, "num_stages": num_stages}
    return block_n, block_k, launch | ({"maxnreg": _TILE[4]} if len(_TILE) > 4 else {})


def _check_tiled_tile(variant: int, block_k: int) -> None:
    if variant == 7 and block_k != 128:
        raise ValueError(f"nvfp4_moe: kernel v{variant} reads 128-K chunks (nvfp4_words); a "
                         f"launch-config override gave BLOCK_K {block_k}")


def _alone_without_alignment(x: torch.Tensor, topk_ids: torch.Tensor, E: int, I: int) -> bool:
    """Whether the routed experts alone (no shared expert in the routing) take
    `_nvfp4_moe_impl`'s no-alignment path, given aligned there and PDL edges: the Gluon
    gate/up and down kernels, the down kernel's tickets and own routing, I >= 256 and a
    routing the gate/up programs route themselves."""
    T, K = topk_ids.shape
    H, variant = x.shape[1], effective_variant(x.shape[1], I)
    gluon_down = (_launch_config(I, H, _GATE_UP_BLOCK_N[variant], "gate_up")[0] == 128
                  and down_gluon_applies(x.device, variant, H, I, False, OPAQUE_OP,
                                         route_block_m(T, K, E)))
    pdl = overlap_active(x.device) and overlap_pdl(x.device)
    return (gate_up_applies(x.device, variant, H, I, False, OPAQUE_OP, pdl, E, gluon_down, False)
            and down_tickets() and I >= 256 and _nvfp4_down_self_route.DOWN_SELF_ROUTE
            and self_routes(topk_ids, T * K, E, "first", True))


def _alphas(scale_2: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    alpha = scale_2.float().reshape(-1)  # [E]
    return alpha if input_scale is None else alpha * input_scale.float().reshape(-1)


def _nvfp4_moe_impl(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    gate_weight: torch.Tensor, gate_weight_scale: torch.Tensor, gate_weight_scale_2: torch.Tensor,
    up_weight: torch.Tensor, up_weight_scale: torch.Tensor, up_weight_scale_2: torch.Tensor,
    down_weight: torch.Tensor, down_weight_scale: torch.Tensor, down_weight_scale_2: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None, block_m: int = 0,
    sorted_pair: torch.Tensor | None = None, expert_of_block: torch.Tensor | None = None,
    pairs: bool = False,
) -> torch.Tensor:
    """Body of `dlmc::nvfp4_moe`. Same tensors as `nvfp4_moe`, except that the block scales are
    their uint8 bit patterns and the
    W4A4 activation scales come pre-combined: `gate_up_input_scale` fp32 `[E]` (shared by gate
    and up) and `down_input_scale` fp32 `[E]` (None: no emulation).
    `shared_*` (all three or none): the BF16 shared expert, run as extra programs (parts).
    `sorted_pair` / `expert_of_block` at `block_m`: the pairs' alignment if already made (with
    the shared expert's tail when `shared_*` are given; None: aligned here). `pairs`: return
    the pair rows `[T*P, H]` uncombined (`nvfp4_moe`)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = gate_weight.shape[0], gate_weight.shape[1]
    variant = effective_variant(H, I)
    has_shared = shared_gate is not None and shared_up is not None and shared_down is not None
    shared = int(has_shared)  # an int: a bool in symbolic-shape arithmetic fails to trace
    pairs_per_token = K + shared  # the shared expert's pair of token t: t*(K+1) + K
    out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return out  # ([0, H] whether combined or not)
    num_pairs = T * pairs_per_token
    edges = edge_pdl(x.device) and down_input_scale is None  # alignment and combine with PDL
    aligned_here = sorted_pair is None or expert_of_block is None
    # whether the routed experts alone take the no-alignment path (`no_align` below)
    routed_alone = aligned_here and edges and _alone_without_alignment(x, topk_ids, E, I)
    # `DLMC_NVFP4_SHARED_ITEMS` (`_nvfp4_shared_items`, where the routed experts alone take
    # that path): the routed pairs as if alone (`t*K + k`), the shared expert as items of the
    # two Gluon launches
    items = (has_shared and gate_up_input_scale is None and shared_items_apply(T, H, I)
             and routed_alone)
    in_routing = has_shared and not items  # the shared expert's pairs in the alignment
    if aligned_here:  # else aligned by dlmc::moe_route_align (which also wrote topk_ids)
        block_m = route_block_m(T, K, E, in_routing)
    a, a_row_div = x.contiguous(), pairs_per_token
    if gate_up_input_scale is not None:  # W4A4 emulation: quantize each routed pair's row
        pair_expert = topk_ids.reshape(-1).long()  # [T*K]
        a = fake_quantize_activation(x.repeat_interleave(K, dim=0),
                                     gate_up_input_scale.float()[pair_expert])  # [T*K, H]
        if has_shared:  # the shared expert (BF16) reads x as is: rows t*(K+1) + K
            a = torch.cat([a.view(T, K, H), x[:, None]], dim=1).reshape(num_pairs, H)
        a_row_div = 1
    routed_pairs, routed_div = (T * K, K) if items else (num_pairs, a_row_div)  # (Gluon kernels)
    g_w, u_w, d_w = (shared_gate, shared_up, shared_down) if has_shared else (x, x, x)
    block_n1, block_k1, launch = _launch_config(I, H, _GATE_UP_BLOCK_N[variant], "gate_up")
    _check_tiled_tile(variant, block_k1)
    parts1 = shared_parts(T, block_m, block_n1) if has_shared else 0
    # `moe_overlap`: down programs wait per slot (routing block, shared token chunk), not for
    # the whole gate/up launch; both grids then run a slot's N-tiles one after the other.
    # `DLMC_NVFP4_DOWN=gluon`: the routed down projection in `_nvfp4_down_gluon` (gate/up's
    # 128-column tiles store h even columns first), the shared expert's down parts alone in
    # the Triton kernel
    gluon_down = block_n1 == 128 and down_gluon_applies(
        x.device, variant, H, I, down_input_scale is not None, OPAQUE_OP, block_m)
    overlap = overlap_active(x.device) and down_input_scale is None
    pdl = PDL_LAUNCH if overlap and overlap_pdl(x.device) else {}
    # `DLMC_NVFP4_DOWN=fused`: the routed experts' gate/up and down in one Gluon kernel
    # (`_nvfp4_moe_gluon`), launched last; the shared expert's parts alone in the Triton kernels
    fused = fused_applies(x.device, variant, H, I, down_input_scale is not None, OPAQUE_OP,
                          bool(pdl), E)
    # `DLMC_NVFP4_GATE_UP=gluon` (with the Gluon down kernel, no shared expert): the routed
    # gate/up projection as the fused kernel's gate/up items alone, launched before the Gluon
    # down kernel (which then waits for each 8-slot part's items)
    gluon_gate_up = gate_up_applies(x.device, variant, H, I, down_input_scale is not None,
                                    OPAQUE_OP, bool(pdl), E, gluon_down, in_routing)
    # `DLMC_NVFP4_DOWN_SELF_ROUTE`: no alignment launch; the self-routed gate/up launches
    # first, then the down kernel, which routes its own items (the buffers only give shapes)
    no_align = routed_alone and not in_routing
    if no_align:
        sorted_pair, expert_of_block = alignment_buffers(topk_ids, E, block_m)
    elif aligned_here:
        _, sorted_pair, expert_of_block = route_pairs(topk_ids, E, in_routing, edges)
    num_blocks = expert_of_block.shape[0]
    # h: a row per routing slot, then (shared expert) a row per token (`moe_shared_parts`).
    routed_rows = num_blocks * block_m
    h = torch.empty((routed_rows + shared * -(-T // block_m) * block_m, I), dtype=torch.bfloat16,
                    device=x.device)
    num_slots = num_blocks + shared * -(-T // block_m)
    # (unread without overlap; a Gluon kernel with a ticket counter: one more slot's room, for
    # it; the fused kernel's launch checks for that room)
    ticket_room = int(fused or gluon_gate_up or (gluon_down and down_tickets()))
    count = counters(x.device, num_slots + ticket_room) if overlap else expert_of_block
    tiles1 = triton.cdiv(I, block_n1)
    rows1 = parts1 if fused or gluon_gate_up else num_blocks + parts1
    gate_alpha = _alphas(gate_weight_scale_2, gate_up_input_scale)
    up_alpha = _alphas(up_weight_scale_2, gate_up_input_scale)
    y = torch.empty((num_pairs, H), dtype=torch.bfloat16, device=x.device)
    block_n2, block_k2, launch2 = _launch_config(H, I, _DOWN_BLOCK_N[variant], "down")
    _check_tiled_tile(variant, block_k2)
    parts2 = shared_parts(T, block_m, block_n2) if has_shared else 0
    tiles2 = triton.cdiv(H, block_n2)
    # `DLMC_NVFP4_SHARED_DOWN=gate_up` (with the Gluon down kernel): the shared expert's down
    # parts as the last programs of gate/up's launch, so that the Gluon kernel follows gate/up
    # directly (under the interpreter, which runs a grid column by column, only with one column)
    fold = (gluon_down and has_shared and overlap and shared_down_in_gate_up()
            and (not _INTERPRETED or tiles1 == 1))
    extra1 = triton.cdiv(parts2 * tiles2, tiles1) if fold else 0  # (fold: with overlap)
    grid1 = (tiles1, rows1 + extra1) if overlap else (rows1, tiles1)
    if rows1 and not items:
        launcher(_gate_up_kernel)[grid1](
            a, sorted_pair, expert_of_block, gate_weight, gate_weight_scale,
            up_weight, up_weight_scale, gate_alpha, up_alpha, h, num_pairs, a_row_div, H, I,
            a.stride(0), h.stride(0), g_w, u_w, E, num_blocks, pairs_per_token, count,
            BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=block_k1, INTERPRETED=_INTERPRETED,
            VARIANT=variant, SHARED=has_shared, SHARED_BLOCK_K=shared_block_k(H, "gate_up"),
            SHARED_SPLIT=shared_split(block_n1), OVERLAP=overlap, H_EVEN_ODD=gluon_down,
            PARTS_ONLY=fused, **pdl, **launch,
            **(dict(SHARED_DOWN=True, y_ptr=y, stride_y=y.stride(0), shared_down_w=d_w,
                    num_slots=num_slots, gate_up_rows=rows1, down_parts=parts2,
                    DOWN_TILES=tiles2, DOWN_SPLIT=shared_split(block_n2), DOWN_BLOCK_N=block_n2,
                    DOWN_BLOCK_K=shared_block_k(I, "down")) if fold else {}),
        )
    if down_input_scale is not None:  # the routed rows; the shared expert's (after) stay bf16
        slot_expert = expert_of_block.long().clamp(0, E - 1).repeat_interleave(block_m)  # [S]
        quantized = fake_quantize_activation(h[:routed_rows],
                                             down_input_scale.float()[slot_expert])
        h = torch.cat([quantized, h[routed_rows:]]) if has_shared else quantized
    parts_only = gluon_down or fused  # the routed blocks in a Gluon kernel
    rows2 = 0 if fold or items else parts2 if parts_only else num_blocks + parts2
    grid2 = (tiles2, rows2) if overlap else (rows2, tiles2)
    down_alpha = _alphas(down_weight_scale_2, down_input_scale)
    if rows2:  # with a Gluon kernel, before it (it waits for this launch at its end)
        launcher(_down_kernel)[grid2](
            h, sorted_pair, expert_of_block, down_weight, down_weight_scale, down_alpha, y,
            num_pairs, H, I, h.stride(0), y.stride(0), d_w, E, num_blocks, pairs_per_token,
            count, num_slots, BLOCK_M=block_m,
            BLOCK_N=block_n2, BLOCK_K=block_k2, INTERPRETED=_INTERPRETED, VARIANT=variant,
            SHARED=has_shared, SHARED_BLOCK_K=shared_block_k(I, "down"),
            SHARED_SPLIT=shared_split(block_n2), GATE_UP_TILES=tiles1,
            GATE_UP_SPLIT=shared_split(block_n1), OVERLAP=overlap, PARTS_ONLY=parts_only,
            **pdl, **launch2,
        )
    if fused or gluon_gate_up:  # after the shared expert's Triton parts, if any; gate/up alone
        # before the Gluon down kernel
        launch_moe_gluon(
            a, sorted_pair, expert_of_block,
            (gate_weight, gate_weight_scale, up_weight, up_weight_scale, down_weight,
             down_weight_scale),
            (gate_alpha, up_alpha, down_alpha), h, y, count, num_slots, routed_pairs, E,
            routed_div, pdl="after" if in_routing else "first" if no_align else "enter",
            **({"shared_items": (g_w, u_w, routed_rows, num_blocks)} if items else {}),
            gate_up_only=gluon_gate_up,
            # the gate/up programs may route themselves while the alignment runs: topk_ids
            # was written before it (its PDL launch waits for the kernel before, then lets
            # gate/up launch); or ("first") they wait for the kernel before themselves
            topk_ids=topk_ids if edges and aligned_here else None)
    if gluon_down:  # (writers: gate/up's programs per block, or its items per 8-slot part)
        launch_down_gluon(h, sorted_pair, expert_of_block, down_weight, down_weight_scale,
                          down_alpha, y, routed_pairs, E,
                          count if overlap else None, num_slots,
                          I // 128 if gluon_gate_up else tiles1, pdl=bool(pdl),
                          per_part=gluon_gate_up, topk_ids=topk_ids if no_align else None,
                          **({"pair_gap": K, "shared_items": (d_w, routed_rows, num_blocks, T)}
                             if items else {}))
    if pairs:
        return y  # [T*P, H]
    return combine_pairs(y, topk_weights, out, has_shared, edges)  # [T, H]


_BODY_ARGS = list(inspect.signature(_nvfp4_moe_impl).parameters)[2:]  # after x, topk_ids


def _nvfp4_moe_fake(x: torch.Tensor, topk_ids: torch.Tensor, *args: object,
                    **kwargs: object) -> torch.Tensor:
    """`[T, H]`, or with `pairs` `[T*P, H]` (the body's arguments, positional or by name)."""
    given = dict(zip(_BODY_ARGS, args, strict=False)) | kwargs
    rows = x.shape[0]
    if given.get("pairs", False):
        rows *= topk_ids.shape[1] + int(given.get("shared_gate") is not None)
    return x.new_empty((rows, x.shape[1]), dtype=torch.bfloat16)


# Inductor traces through the body (the routing-prep kernel, the two grouped kernels and the
# combine); an opaque op under the interpreter and with `DLMC_NVFP4_OVERLAP=1` (the default:
# its kernels launch with PDL and the per-slot counters, `moe_overlap`).
_nvfp4_moe_op = traced_triton_op("dlmc::nvfp4_moe", _nvfp4_moe_impl, _nvfp4_moe_fake,
                                 opaque=OPAQUE_OP)


def _input_scales(gate: torch.Tensor | None, up: torch.Tensor | None, down: torch.Tensor | None,
                  emulate_w4a4: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not emulate_w4a4:
        return None, None
    if gate is None or up is None or down is None:
        raise ValueError("nvfp4_moe: emulate_w4a4=True needs gate_input_scale, up_input_scale "
                         "and down_input_scale")
    # One activation scale per expert for the shared gate/up input: the max of the two (vLLM).
    return torch.maximum(gate, up), down


def nvfp4_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    gate_weight: torch.Tensor, gate_weight_scale: torch.Tensor, gate_weight_scale_2: torch.Tensor,
    up_weight: torch.Tensor, up_weight_scale: torch.Tensor, up_weight_scale_2: torch.Tensor,
    down_weight: torch.Tensor, down_weight_scale: torch.Tensor, down_weight_scale_2: torch.Tensor,
    *, gate_input_scale: torch.Tensor | None = None, up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None, emulate_w4a4: bool = False,
    shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None, routing: PairRouting | None = None,
    pairs: bool = False,
) -> torch.Tensor:
    """Routed-expert MoE with NVFP4 experts (Triton, `dlmc::nvfp4_moe`).

    Shapes (E experts, H hidden, I expert width, T tokens, K experts per token; H, I % 16 == 0):
    - x bf16 `[T, H]`; topk_ids int32/int64 `[T, K]` in `[0, E)`; topk_weights fp32 `[T, K]`
      (routed scaling already folded in).
    - `{gate,up}_weight` uint8 `[E, I, H/2]`, `down_weight` uint8 `[E, H, I/2]`: E2M1 codes, low
      nibble = even element; `*_weight_scale` float8_e4m3fn `[E, out, in/16]` (row-major, not
      swizzled); or kernel v7's stored forms (`nvfp4_words.stored_forms`: int32 `[E, out,
      in/8]` words, int8 `[E, out, in/16]` codes); each form is converted exactly to the other
      when needed; `*_weight_scale_2` fp32 `[E]` global scales (gate and up kept separate).
    - `*_input_scale` fp32 `[E]`: used only with `emulate_w4a4=True`, which fake-quantizes the
      activations as W4A4 kernels do (gate/up input: per-expert max of the two scales, as vLLM).
    - `shared_gate`, `shared_up` bf16 `[I, H]`, `shared_down` bf16 `[H, I]` (all three or none): a
      BF16 shared expert that every token also takes with weight 1.0. Its `T` rows run in the
      same two launches, as extra programs of a few columns each (`moe_shared_parts`; the
      routing keeps its shared tail, `route_pairs(..., shared_expert=True)`), with
      `bf16_moe`'s tile dot and epilogue: `bf16(down(bf16(bf16(silu(g)) * u)))` with `g`, `u` the
      bf16-rounded projections, i.e. `SwiGLUMLP`'s bf16 maths; it reads x unquantized with
      `emulate_w4a4`.
    - `routing`: the pairs' alignment if already made (`route_pairs(topk_ids, E, shared)`'s,
      e.g. by `moe_route_align`); None aligns them here.
    Returns bf16 `[T, H]`: `sum_k topk_weights[t, k] * bf16(expert_k(x[t]))` (+ the shared
    expert's bf16 output), summed in fp32. All tensors on one device, contiguous. No host sync:
    capturable in a CUDA graph. `pairs=True` returns the uncombined rows instead, bf16
    `[T*P, H]` (row `t*P + k`: pair (t, k); P = K, or K+1 with the shared expert's row last),
    which `moe_combine.combine_pointwise` (or `moe_combine`) sums to the same `[T, H]`.
    """
    weights = {"gate_weight": gate_weight, "gate_weight_scale": gate_weight_scale,
                   "gate_weight_scale_2": gate_weight_scale_2, "up_weight": up_weight,
                   "up_weight_scale": up_weight_scale, "up_weight_scale_2": up_weight_scale_2,
                   "down_weight": down_weight, "down_weight_scale": down_weight_scale,
                   "down_weight_scale_2": down_weight_scale_2}
    scales = {"gate_input_scale": gate_input_scale, "up_input_scale": up_input_scale,
              "down_input_scale": down_input_scale}
    check_arguments(x, topk_ids, topk_weights,
                    weights | {k: v for k, v in scales.items() if v is not None})
    shared = check_shared_expert(weights["gate_weight"], x.shape[1], shared_gate, shared_up,
                                 shared_down)
    a1, a2 = _input_scales(gate_input_scale, up_input_scale, down_input_scale, emulate_w4a4)
    # The op takes the block scales as bit patterns (free views; opcheck's schema test cannot
    # compare fp8 tensors on CPU): uint8 E4M3 bytes, or v7's codes. Weights likewise: uint8
    # ModelOpt bytes, or v7's tiled words viewed as bytes (tiled ModelOpt bytes and E4M3 scales
    # under the interpreter), `nvfp4_words`. Each stored form converts exactly.
    variant = effective_variant(x.shape[1], weights["gate_weight"].shape[1])
    op_args = []
    for proj in ("gate", "up", "down"):
        op_args += [*projection_operands(weights[f"{proj}_weight"],
                                         weights[f"{proj}_weight_scale"], variant, _INTERPRETED),
                    weights[f"{proj}_weight_scale_2"]]
    if routing is not None:
        check_pair_routing("nvfp4_moe", routing)
    return _nvfp4_moe_op(x, topk_ids, topk_weights, *op_args, a1, a2, *shared,
                         *(routing or (0, None, None)), pairs)


def nvfp4_moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    gate_weight: torch.Tensor, gate_weight_scale: torch.Tensor, gate_weight_scale_2: torch.Tensor,
    up_weight: torch.Tensor, up_weight_scale: torch.Tensor, up_weight_scale_2: torch.Tensor,
    down_weight: torch.Tensor, down_weight_scale: torch.Tensor, down_weight_scale_2: torch.Tensor,
    *, gate_input_scale: torch.Tensor | None = None, up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None, emulate_w4a4: bool = False,
    shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch definition of `nvfp4_moe` (same arguments and result).

    Per pair: `g = (a @ Wg^T) * s2_g`, `u = (a @ Wu^T) * s2_u` in fp32 with `W = e2m1 * block_scale`
    (exact), `h = bf16(silu(g) * u)`, `y = bf16((h @ Wd^T) * s2_d)`; then
    `out = bf16(sum_k w_k * float(y_k))`. With W4A4 emulation `a`/`h` are `fake_quantize_activation`
    outputs and each `s2` is multiplied by the activation's input scale. `shared_*`: plus
    `1.0 * float(shared(x))` in the fp32 sum, `shared` the SwiGLU MLP in x's dtype (`SwiGLUMLP`).
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    a1, a2 = _input_scales(gate_input_scale, up_input_scale, down_input_scale, emulate_w4a4)
    gate_weight_scale, up_weight_scale, down_weight_scale = (
        e4m3_scales(s) for s in (gate_weight_scale, up_weight_scale, down_weight_scale))
    gate_weight, up_weight, down_weight = (weight_operand(w, "plain")
                                           for w in (gate_weight, up_weight, down_weight))
    y = torch.zeros((T * K, H), dtype=torch.bfloat16, device=x.device)
    pair_expert = topk_ids.reshape(-1).long()  # [P]
    for e in range(gate_weight.shape[0]):
        pairs = torch.nonzero(pair_expert == e).flatten()  # [n]
        if pairs.numel() == 0:
            continue
        a = x[pairs // K]  # [n, H] bf16
        alpha_g, alpha_u, alpha_d = (gate_weight_scale_2[e].float(), up_weight_scale_2[e].float(),
                                     down_weight_scale_2[e].float())
        if a1 is not None and a2 is not None:
            a = fake_quantize_activation(a, a1[e].reshape(1))
            alpha_g, alpha_u, alpha_d = alpha_g * a1[e], alpha_u * a1[e], alpha_d * a2[e]
        g = a.float() @ dequantize_blocks(gate_weight[e], gate_weight_scale[e]).T * alpha_g
        u = a.float() @ dequantize_blocks(up_weight[e], up_weight_scale[e]).T * alpha_u
        h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)  # [n, I]
        if a2 is not None:
            h = fake_quantize_activation(h, a2[e].reshape(1))
        wd = dequantize_blocks(down_weight[e], down_weight_scale[e])  # [H, I]
        y[pairs] = (h.float() @ wd.T * alpha_d).to(torch.bfloat16)
    combined = (y.view(T, K, H).float() * topk_weights.float()[..., None]).sum(dim=1)
    if shared_gate is not None and shared_up is not None and shared_down is not None:
        F = torch.nn.functional
        g, u = F.linear(x, shared_gate.to(x.dtype)), F.linear(x, shared_up.to(x.dtype))
        shared_y = F.linear(F.silu(g) * u, shared_down.to(x.dtype))  # [T, H]
        combined = combined + shared_y.float()  # weight 1.0, in the fp32 sum
    return combined.to(torch.bfloat16)
