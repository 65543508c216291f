"""Plain-PyTorch references of `dlmc::nvfp4_moe`'s two Gluon launches, from their own arguments.

`gate_up_gluon_reference` and `down_gluon_reference` take exactly what `launch_gate_up_gluon` and
`launch_down_gluon` take (the aligned form: the routing's `sorted_pair` / `expert_of_block`
already written) and compute what those kernels compute: each routed pair's rows from the
expert weights passed to the launch (decoded from the stored form the launch reads) and the
per-expert global scales passed to it, with the kernels' roundings (bf16 h in even-odd column
order, bf16 y) and their counter bookkeeping. On a machine without sm_90 the op's wiring runs
through them (tests/custom_ops/test_nvfp4_*_gluon.py), so a wrong argument of a launch, a
swapped global scale say, changes the op's output there too. Summation order aside, they equal
the kernels bit for bit on the H200 (the GPU tests compare the kernels with the Triton ones).
"""

from __future__ import annotations

import torch

from dlmc.custom_ops._pdl import INTERPRETED
from dlmc.custom_ops.nvfp4_words import CHUNK_K, _untile, e4m3_scales, untile_scales, weight_operand
from dlmc.quant.nvfp4_format import dequantize_blocks

__all__ = ["decode_launch_weights", "down_gluon_reference", "gate_up_gluon_reference"]


def decode_launch_weights(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One projection's weights as a Gluon launch receives them (uint8 views: v7's words and
    int8 scale codes compiled; ModelOpt's bits and E4M3 scales, tiled, under the interpreter)
    -> fp32 `[E, N, K]` values `e2m1 * block_scale` (no global scale), exactly."""
    if INTERPRETED:
        plain = _untile(weight, CHUNK_K // 2)
        e4m3 = untile_scales(scale)
    else:
        plain = weight_operand(weight.view(torch.int32), "plain")
        e4m3 = e4m3_scales(scale.view(torch.int8))
    return torch.stack([dequantize_blocks(plain[e], e4m3[e]) for e in range(plain.shape[0])])


def _even_odd(h: torch.Tensor) -> torch.Tensor:
    """Natural columns -> each 128 columns even first, then odd (the gate/up kernels' store)."""
    rows, cols = h.shape
    return h.reshape(rows, cols // 128, 64, 2).transpose(2, 3).reshape(rows, cols)


def _natural(h: torch.Tensor) -> torch.Tensor:
    """Inverse of `_even_odd`."""
    rows, cols = h.shape
    return h.reshape(rows, cols // 128, 2, 64).transpose(2, 3).reshape(rows, cols)


def _aligned_only(name: str, topk_ids: torch.Tensor | None, shared_items: tuple | None) -> None:
    if topk_ids is not None or shared_items is not None:
        raise ValueError(f"{name}: the reference takes the aligned form (topk_ids=None, no "
                         "shared items); the self-routed forms are checked on the GPU")


def gate_up_gluon_reference(x: torch.Tensor, sorted_pair: torch.Tensor,
                            expert_of_block: torch.Tensor, weights: tuple[torch.Tensor, ...],
                            alphas: tuple[torch.Tensor, ...], h: torch.Tensor,
                            count: torch.Tensor, num_pairs: int, shared_id: int, a_row_div: int,
                            topk_ids: torch.Tensor | None = None,
                            shared_items: tuple | None = None) -> None:
    """`launch_gate_up_gluon`'s result: `h[slot] = bf16(silu(g) * u)`, `g = alpha_g[e] * x @
    gate[e]^T`, `u = alpha_u[e] * x @ up[e]^T` for every routed pair (pair p reads x row
    p // `a_row_div`), stored even-odd; each item (an 8-slot part that holds a pair, one of
    `I / 128` column tiles) counts itself done on its block's counter."""
    _aligned_only("gate_up_gluon_reference", topk_ids, shared_items)
    gate = decode_launch_weights(weights[0], weights[1])  # [E, I, H] fp32
    up = decode_launch_weights(weights[2], weights[3])
    alpha_g, alpha_u = (a.float() for a in alphas)
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    for block, expert in enumerate(expert_of_block.tolist()):
        if expert < 0 or expert == shared_id:
            continue
        for first in range(block * block_m, (block + 1) * block_m, 8):
            slots = [s for s in range(first, first + 8) if int(sorted_pair[s]) < num_pairs]
            if not slots:
                continue  # a part without pairs: no items
            rows = x[[int(sorted_pair[s]) // a_row_div for s in slots]].float()  # [n, H]
            g = rows @ gate[expert].T * alpha_g[expert]  # [n, I]
            u = rows @ up[expert].T * alpha_u[expert]
            h[slots] = _even_odd((g * torch.sigmoid(g) * u).bfloat16())
            count[block] += h.shape[1] // 128


def down_gluon_reference(h: torch.Tensor, sorted_pair: torch.Tensor,
                         expert_of_block: torch.Tensor, words: torch.Tensor,
                         codes: torch.Tensor, alpha: torch.Tensor, y: torch.Tensor,
                         num_pairs: int, shared_id: int, count: torch.Tensor, num_slots: int,
                         writers: int, per_part: bool = False,
                         topk_ids: torch.Tensor | None = None, pair_gap: int = 0,
                         shared_items: tuple | None = None) -> None:
    """`launch_down_gluon`'s result: `y[pair] = bf16(alpha[e] * h[slot] @ down[e]^T)` for every
    routed pair (h read in the gate/up kernels' even-odd columns); the last reader of each
    routed block zeroes its two counters, as the kernel does."""
    _aligned_only("down_gluon_reference", topk_ids, shared_items)
    down = decode_launch_weights(words, codes)  # [E, H, I] fp32
    natural = _natural(h.float())
    block_m = sorted_pair.shape[0] // expert_of_block.shape[0]
    for block, expert in enumerate(expert_of_block.tolist()):
        if expert < 0 or expert == shared_id:
            continue
        count[block] = 0
        count[num_slots + block] = 0
        for slot in range(block * block_m, (block + 1) * block_m):
            pair = int(sorted_pair[slot])
            if pair < num_pairs:
                row = pair + pair // pair_gap if pair_gap else pair
                y[row] = (natural[slot] @ down[expert].T * alpha[expert].float()).bfloat16()
