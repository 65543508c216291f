"""Routed experts kept in NVFP4 (ModelOpt layout), run by the `dlmc::nvfp4_moe` op.

Same forward signature as the BF16 experts module: `forward(x [T, H], topk_ids [T, K],
topk_weights [T, K], shared_expert=False) -> [T, H]`; `set_shared_expert` (after loading) adds a
BF16 shared expert that the op runs as the dense tail blocks of its two launches. The loader
stacks checkpoint tensor `model.layers.L.mlp.experts.E.<proj>.<suffix>` into buffer
`<proj>_<suffix>[E]`, e.g. `...experts.3.gate_proj.weight_scale_2` -> `gate_proj_weight_scale_2[3]`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dlmc.custom_ops import moe_combine
from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.custom_ops.nvfp4_moe import effective_variant, nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_moe_tiles import ACTIVATIONS, NVFP4Tiles, default_tiles
from dlmc.custom_ops.nvfp4_words import ROWS as LAYOUT_WIDTH
from dlmc.custom_ops.nvfp4_words import e4m3_scales, stored_forms, weight_operand
from dlmc.models.diffusion_gemma import GemmaAttention
from dlmc.models.diffusion_gemma_layers import GatedMLP
from dlmc.models.diffusion_gemma_moe import GemmaExperts
from dlmc.quant.nvfp4_format import GROUP_SIZE, dequantize_nvfp4

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_EXPERT_TENSOR = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_2|input_scale)$"
)


def widen_experts(buffers: dict[str, torch.Tensor], inter: int,
                  padded: int) -> dict[str, torch.Tensor]:
    """The packed codes and block scales of experts of width `inter` widened to `padded` with
    zeros (`<proj>_weight [E, N, K/2]` and `<proj>_weight_scale [E, N, K/16]`, ModelOpt's
    forms): gate/up gain `padded - inter` rows, down as many columns. Returns the six new
    tensors; the others in `buffers` are not read."""
    out = {}
    for proj, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
        for suffix, per in (("weight", 2), ("weight_scale", GROUP_SIZE)):
            old = buffers[f"{proj}_{suffix}"]
            shape = list(old.shape)
            shape[dim] = (padded - inter) // (1 if dim == 1 else per)
            zeros = torch.zeros(shape, dtype=old.dtype, device=old.device)
            out[f"{proj}_{suffix}"] = torch.cat([old, zeros], dim=dim).contiguous()
    return out


def expert_buffer_target(tensor_name: str) -> tuple[int, int, str] | None:
    """`model.layers.L.mlp.experts.E.<proj>.<suffix>` -> `(L, E, "<proj>_<suffix>")`, else None.

    The loader copies the tensor into `layers[L].mlp.experts.<proj>_<suffix>[E]` (scalars of shape
    `[]` or `[1]` into one element of the `[E]` buffer).
    """
    match = _EXPERT_TENSOR.match(tensor_name)
    if match is None:
        return None
    layer, expert, proj, suffix = match.groups()
    return int(layer), int(expert), f"{proj}_{suffix}"


class NVFP4Experts(nn.Module):
    """`num_experts` gated experts `down(act(gate(x)) * up(x))` with NVFP4 weights: `activation`
    "silu" (SwiGLU, LLaDA2) or "gelu_tanh" (DiffusionGemma's `gelu_pytorch_tanh`).

    Buffers (E = num_experts, H = hidden_size, I = intermediate_size):
    - `gate_proj_weight`, `up_proj_weight`: uint8 `[E, I, H/2]`; `down_proj_weight`: uint8
      `[E, H, I/2]` (E2M1 codes, low nibble = even element).
    - `<proj>_weight_scale`: float8_e4m3fn `[E, out, in/16]` (row-major, unswizzled), as loaded;
      `prepare_for_kernel()` (a load-time step) replaces weights and scales by kernel v7's tiled
      forms where the shapes take its layout: int32 weight words `[E, out, in/8]` and int8
      scale codes (exact; `custom_ops/nvfp4_words.py`, `custom_ops/nvfp4_scale_codes.py`).
    - `<proj>_weight_scale_2`: fp32 `[E]` global scales; `<proj>_input_scale`: fp32 `[E]`
      activation scales (only used with `emulate_w4a4`; 1.0 until loaded).

    - after `set_shared_expert`: `shared_{gate,up,down}_proj_weight` `[I, H]`, `[I, H]`, `[H, I]`
      (non-persistent, bf16 for the op), the shared expert (`shared_expert_id` is then E).

    `use_reference=True` runs `nvfp4_moe_reference` (plain PyTorch, any device) instead of the
    Triton op; `emulate_w4a4=True` fake-quantizes activations with the input scales (Blackwell-like
    numerics). `pdl`: the op's programmatic dependent launches (`KernelConfig.pdl`, set by
    `apply_kernel_config`); `tiles`: changes to the op's tiles (`KernelConfig.nvfp4_tiles`,
    likewise; empty: the op's choice).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        use_reference: bool = False,
        emulate_w4a4: bool = False,
        pdl: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size % GROUP_SIZE:
                raise ValueError(f"NVFP4Experts: {name}={size} must be a multiple of {GROUP_SIZE}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"NVFP4Experts: activation={activation!r}, expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.checkpoint_intermediate_size = intermediate_size  # (`pad_to_layout` widens I)
        self.activation = activation
        self.use_reference = use_reference
        self.emulate_w4a4 = emulate_w4a4
        self.pdl = pdl
        self.tiles = ""
        E, H, I = num_experts, hidden_size, intermediate_size
        for proj, (out_f, in_f) in zip(PROJECTIONS, ((I, H), (I, H), (H, I)), strict=True):
            self.register_buffer(
                f"{proj}_weight", torch.zeros(E, out_f, in_f // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                f"{proj}_weight_scale",
                torch.zeros(E, out_f, in_f // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device),
            )
            self.register_buffer(
                f"{proj}_weight_scale_2", torch.ones(E, dtype=torch.float32, device=device)
            )
            self.register_buffer(
                f"{proj}_input_scale", torch.ones(E, dtype=torch.float32, device=device)
            )
        self.shared_expert_id: int | None = None

    @torch.no_grad()
    def prepare_for_kernel(self) -> bool:
        """Load-time step into the form the op's kernel reads, one projection at a time, freeing
        the old copy (the reference and `dequantize_to_bf16` convert back exactly when asked):
        kernel v7's tiled layout (int32 weight words, int8 scale codes with negative and zero
        scales folded into the words) where the shapes allow it; shapes the layout cannot take
        run kernel v3 on the checkpoint's forms (`nvfp4_words.stored_forms`). Does nothing for
        the reference path or v3. Returns whether it converted."""
        variant = effective_variant(self.hidden_size, self.intermediate_size)
        if self.use_reference or variant < 4:
            return False
        for proj in PROJECTIONS:
            w, s = f"{proj}_weight", f"{proj}_weight_scale"
            self._buffers[w], self._buffers[s] = stored_forms(self._buffers[w],
                                                              self._buffers[s], variant)
        return True

    @torch.no_grad()
    def pad_to_layout(self) -> bool:
        """Widen experts whose width I is not a multiple of 128 to the next multiple P with zero
        codes and zero block scales, then `prepare_for_kernel` (kernel v7's layout instead of
        v3; `KernelConfig.nvfp4_pad_experts`). gate/up gain P - I zero rows, down P - I zero
        columns: the padded units are act(0) * 0 = 0 and add nothing to down's sums, so the
        experts compute the same up to the order of fp32 sums, reading P / I times the bytes.
        Only on the checkpoint's forms (v3, op path); returns whether it padded."""
        I, H = self.intermediate_size, self.hidden_size
        padded = -(-I // LAYOUT_WIDTH) * LAYOUT_WIDTH
        if self.use_reference or padded == I or effective_variant(H, padded) < 4:
            return False
        self._buffers.update(widen_experts(dict(self._buffers), I, padded))
        self.checkpoint_intermediate_size = I
        self.intermediate_size = padded
        self.prepare_for_kernel()
        return True

    def _op_args(self) -> list[torch.Tensor]:
        return [
            getattr(self, f"{proj}_{suffix}")
            for proj in PROJECTIONS
            for suffix in ("weight", "weight_scale", "weight_scale_2")
        ]

    @torch.no_grad()
    def set_shared_expert(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> int:
        """Keep a shared expert (gate/up `[I, H]`, down `[H, I]`, in the model's dtype: the op
        needs bf16) for `forward(..., shared_expert=True)`; returns its expert id, E (after the
        routed ones)."""
        if self.activation != "silu":
            raise ValueError(f"NVFP4Experts: a shared expert is a SwiGLU MLP; these experts run "
                             f"activation={self.activation!r}")
        I, H = self.intermediate_size, self.hidden_size
        for name, weight, shape in (("gate", gate, (I, H)), ("up", up, (I, H)),
                                    ("down", down, (H, I))):
            if tuple(weight.shape) != shape:
                raise ValueError(f"NVFP4Experts: shared {name} weight must be {shape}, got "
                                 f"{tuple(weight.shape)}")
            self.register_buffer(f"shared_{name}_proj_weight",
                                 weight.contiguous(), persistent=False)
        self.shared_expert_id = self.num_experts
        return self.shared_expert_id

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        shared_expert: bool = False,
    ) -> torch.Tensor:
        """x `[T, H]` (bf16 for the op), topk_ids int `[T, K]`, topk_weights fp32 `[T, K]` ->
        `[T, H]` in x's dtype (bf16 values).

        `out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`, summed in fp32 over
        bf16 expert outputs (routed scaling belongs in `topk_weights`). `shared_expert`: plus the
        shared expert's bf16 output with weight 1.0 in the same fp32 sum (`set_shared_expert`).
        """
        moe = nvfp4_moe_reference if self.use_reference else nvfp4_moe
        kwargs: dict[str, object] = {"activation": self.activation}
        if self.emulate_w4a4:
            kwargs |= {
                "gate_input_scale": self.gate_proj_input_scale,
                "up_input_scale": self.up_proj_input_scale,
                "down_input_scale": self.down_proj_input_scale,
            }
        if shared_expert:
            if self.shared_expert_id is None:
                raise ValueError("NVFP4Experts: shared_expert=True needs set_shared_expert first")
            kwargs |= {f"shared_{p}": getattr(self, f"shared_{p}_proj_weight")
                       for p in ("gate", "up", "down")}
        if self.tiles and not self.use_reference:
            T, K = topk_ids.shape
            H, I = self.hidden_size, self.intermediate_size
            own = default_tiles(T, K, self.num_experts, H, I, effective_variant(H, I),
                                shared_expert)
            kwargs["tiles"] = NVFP4Tiles.parse(self.tiles, own)
        if not self.use_reference and torch.compiler.is_compiling():
            # The pair rows, summed by pointwise ops that Inductor fuses into their consumer
            # (eager runs keep the one combine launch instead of 2K+1 pointwise ones).
            rows = moe(x, topk_ids, topk_weights, *self._op_args(),
                       emulate_w4a4=self.emulate_w4a4, pairs=True, pdl=self.pdl, **kwargs)
            return moe_combine.combine_pointwise(rows, topk_weights, shared_expert)
        if not self.use_reference:
            kwargs["pdl"] = self.pdl
        out = moe(x, topk_ids, topk_weights, *self._op_args(), emulate_w4a4=self.emulate_w4a4,
                  **kwargs)  # [T, H] bf16
        return out.to(x.dtype)

    @torch.no_grad()
    def dequantize_to_bf16(self) -> dict[str, torch.Tensor]:
        """Exact dequantization for `precision="bf16"`: `{proj: bf16 [E, out, in]}`.

        Each value is `e2m1 * block_scale * weight_scale_2` formed in fp32 and rounded once to bf16.
        """
        result = {}
        for proj in PROJECTIONS:
            packed = weight_operand(getattr(self, f"{proj}_weight"), "plain")  # [E, out, in/2]
            scale = e4m3_scales(getattr(self, f"{proj}_weight_scale"))  # [E, out, in/16]
            scale_2 = getattr(self, f"{proj}_weight_scale_2")  # [E]
            out = torch.empty(
                (*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.bfloat16,
                device=packed.device,
            )  # [E, out, in]
            for e in range(self.num_experts):  # one expert at a time bounds the fp32 temporaries
                out[e] = dequantize_nvfp4(packed[e], scale[e], scale_2[e])
            result[proj] = out
        width = self.checkpoint_intermediate_size  # without `pad_to_layout`'s zero units
        if width != self.intermediate_size:
            result = {"gate_proj": result["gate_proj"][:, :width].contiguous(),
                      "up_proj": result["up_proj"][:, :width].contiguous(),
                      "down_proj": result["down_proj"][..., :width].contiguous()}
        return result

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size} (checkpoint "
            f"{self.checkpoint_intermediate_size}), activation={self.activation}, "
            f"use_reference={self.use_reference}, "
            f"emulate_w4a4={self.emulate_w4a4}, pdl={self.pdl}, "
            f"shared_expert_id={self.shared_expert_id}"
        )


def apply_kernel_config(model: nn.Module, kernels: KernelConfig) -> None:
    """Hand `kernels`' op-level choices to every module of `model` that runs an op taking them
    (the NVFP4 experts' `pdl`, `nvfp4_tiles` and `nvfp4_pad_experts`; DiffusionGemma's BF16 experts'
    `kernel`, and with `gemma_fused_projections` its attention's and dense MLPs' fused
    weights; LLaDA2's decoder layers' `fuse_post_attention` and `pdl`)."""
    for module in model.modules():
        if hasattr(module, "fuse_post_attention"):  # LLaDA2's DecoderLayer
            module.fuse_post_attention = kernels.fused_post_attention_norm
            module.pdl = kernels.pdl
        if kernels.gemma_fused_projections and isinstance(module, GemmaAttention | GatedMLP):
            module.fuse_projections()
        if isinstance(module, NVFP4Experts):
            module.pdl, module.tiles = kernels.pdl, kernels.nvfp4_tiles
            if kernels.nvfp4_pad_experts:
                module.pad_to_layout()
        if isinstance(module, GemmaExperts):
            module.kernel = kernels.gemma_bf16_experts
