"""`dlmc::nvfp4_moe`: routed-expert MoE over NVFP4 (ModelOpt) expert weights, W4A16 on Hopper.

Each (token, k) pair is sent to expert `topk_ids[t, k]`; the expert computes
`down(act(gate(x)) * up(x))` (act: SiLU, or GELU with the tanh approximation) with weights
dequantized exactly in registers (E2M1 x FP8 block scale -> BF16, BF16 MMA, fp32 accumulation,
the global scales applied per output row in the epilogue), and the bf16 expert outputs are
combined in fp32: `out[t] = sum_k topk_weights[t, k] * y[t, k]`
(`moe_combine.combine_pairs`).
Design in docs/nvfp4.md (§2 the maths, §3.2 the grouped GEMMs); the maths is defined by
`nvfp4_moe_reference`. The op's body (which kernels run, their launches) is
`_nvfp4_moe_launch` (its Triton kernels' tiles: `nvfp4_moe_tiles`), the argument checks are in
`nvfp4_moe_checks`, the load-time layout of kernel v7 in `nvfp4_words` and `nvfp4_scale_codes`.
"""

from __future__ import annotations

import inspect

import torch

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops._pdl import INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_moe_checks import (
    check_activation,
    check_arguments,
    check_shared_expert,
)
from dlmc.custom_ops.nvfp4_moe_tiles import NVFP4Tiles
from dlmc.custom_ops.nvfp4_words import e4m3_scales, projection_operands, weight_operand
from dlmc.quant.nvfp4_format import dequantize_blocks, fake_quantize_activation

__all__ = ["NVFP4Tiles", "effective_variant", "nvfp4_moe", "nvfp4_moe_reference"]

effective_variant = launch.effective_variant  # (what `NVFP4Experts` stores its weights for)
_BODY_ARGS = list(inspect.signature(launch.run_nvfp4_moe).parameters)[2:]  # after x, topk_ids


def _nvfp4_moe_fake(x: torch.Tensor, topk_ids: torch.Tensor, *args: object,
                    **kwargs: object) -> torch.Tensor:
    """`[T, H]`, or with `pairs` `[T*P, H]` (the body's arguments, positional or by name)."""
    given = dict(zip(_BODY_ARGS, args, strict=False)) | kwargs
    rows = x.shape[0]
    if given.get("pairs", False):
        rows *= topk_ids.shape[1] + int(given.get("shared_gate") is not None)
    return x.new_empty((rows, x.shape[1]), dtype=torch.bfloat16)


# Opaque to Inductor (its kernels launch with PDL and `moe_overlap`'s counters, a buffer of the
# op's own): torch.compile calls the body eagerly.
_nvfp4_moe_op = traced_triton_op("dlmc::nvfp4_moe", launch.run_nvfp4_moe, _nvfp4_moe_fake,
                                 opaque=True)


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
    shared_down: torch.Tensor | None = None, pairs: bool = False, pdl: bool = True,
    activation: str = "silu", tiles: NVFP4Tiles | None = None,
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
      routed experts' launches, as extra programs of a few columns each (`moe_shared_parts`;
      the routing keeps its shared tail, `route_pairs(..., shared_expert=True)`) or as items of
      the Gluon kernels (`_nvfp4_shared_items`), in `SwiGLUMLP`'s bf16 maths:
      `bf16(down(bf16(bf16(silu(g)) * u)))` with `g`, `u` the bf16-rounded projections; it
      reads x unquantized with `emulate_w4a4`.
    Returns bf16 `[T, H]`: `sum_k topk_weights[t, k] * bf16(expert_k(x[t]))` (+ the shared
    expert's bf16 output), summed in fp32. All tensors on one device, contiguous. No host sync:
    capturable in a CUDA graph. `pairs=True` returns the uncombined rows instead, bf16
    `[T*P, H]` (row `t*P + k`: pair (t, k); P = K, or K+1 with the shared expert's row last),
    which `moe_combine.combine_pointwise` (or `moe_combine`) sums to the same `[T, H]`.
    `pdl` (default True): on a CUDA device of sm_90+ the kernels launch with programmatic
    dependent launch, the down programs wait per routing block for gate/up's rows
    (`moe_overlap`), and on sm_90 routings of 16-slot blocks run the Gluon kernels (for at most
    32 tokens with the shared expert as their items); under the CPU interpreter the counters
    run without PDL. False: plain launches of the Triton kernels. Both give the same output bit
    for bit, except that the shared expert's rows as Gluon items sum their products in another
    order.
    `activation`: the experts' gated activation, `h = bf16(act(g) * u)`: "silu" (SwiGLU,
    LLaDA2) or "gelu_tanh" (PyTorch's `gelu(approximate="tanh")` in fp32: DiffusionGemma's
    `gelu_pytorch_tanh`). The Gluon gate/up kernel and the shared expert compute SiLU only:
    "gelu_tanh" runs the Triton gate/up kernel and takes no shared expert.
    `tiles`: the Triton kernels' tiles (`nvfp4_moe_tiles.NVFP4Tiles`); given, both projections
    run in the Triton kernels with them. None: the op's choice by shape (`default_tiles`).
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
    check_activation(activation, shared[0] is not None)
    if tiles is not None and not isinstance(tiles, NVFP4Tiles):
        raise ValueError(f"nvfp4_moe: tiles must be an NVFP4Tiles or None, got {tiles!r}")
    a1, a2 = _input_scales(gate_input_scale, up_input_scale, down_input_scale, emulate_w4a4)
    # The op takes the block scales as bit patterns (free views; opcheck's schema test cannot
    # compare fp8 tensors on CPU): uint8 E4M3 bytes, or v7's codes. Weights likewise: uint8
    # ModelOpt bytes, or v7's tiled words viewed as bytes (tiled ModelOpt bytes and E4M3 scales
    # under the interpreter), `nvfp4_words`. Each stored form converts exactly.
    variant = launch.effective_variant(x.shape[1], weights["gate_weight"].shape[1])
    op_args = []
    for proj in ("gate", "up", "down"):
        op_args += [*projection_operands(weights[f"{proj}_weight"],
                                         weights[f"{proj}_weight_scale"], variant, INTERPRETED),
                    weights[f"{proj}_weight_scale_2"]]
    if tiles is not None:
        tiles.check_shape(variant)
    return _nvfp4_moe_op(x, topk_ids, topk_weights, *op_args, a1, a2, *shared, pairs, pdl,
                         activation, None if tiles is None else tiles.as_list())


def nvfp4_moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    gate_weight: torch.Tensor, gate_weight_scale: torch.Tensor, gate_weight_scale_2: torch.Tensor,
    up_weight: torch.Tensor, up_weight_scale: torch.Tensor, up_weight_scale_2: torch.Tensor,
    down_weight: torch.Tensor, down_weight_scale: torch.Tensor, down_weight_scale_2: torch.Tensor,
    *, gate_input_scale: torch.Tensor | None = None, up_input_scale: torch.Tensor | None = None,
    down_input_scale: torch.Tensor | None = None, emulate_w4a4: bool = False,
    shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None, activation: str = "silu",
) -> torch.Tensor:
    """Plain-PyTorch definition of `nvfp4_moe` (same arguments and result; no launch options).

    Per pair: `g = (a @ Wg^T) * s2_g`, `u = (a @ Wu^T) * s2_u` in fp32 with `W = e2m1 * block_scale`
    (exact), `h = bf16(act(g) * u)` (act: `activation`, "silu" or "gelu_tanh" =
    `gelu(g, approximate="tanh")`, in fp32), `y = bf16((h @ Wd^T) * s2_d)`; then
    `out = bf16(sum_k w_k * float(y_k))`. With W4A4 emulation `a`/`h` are `fake_quantize_activation`
    outputs and each `s2` is multiplied by the activation's input scale. `shared_*`: plus
    `1.0 * float(shared(x))` in the fp32 sum, `shared` the SwiGLU MLP in x's dtype (`SwiGLUMLP`).
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    check_activation(activation, shared_gate is not None)
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
        act = (torch.nn.functional.silu(g) if activation == "silu"
               else torch.nn.functional.gelu(g, approximate="tanh"))  # fp32 [n, I]
        h = (act * u).to(torch.bfloat16)  # [n, I]
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
