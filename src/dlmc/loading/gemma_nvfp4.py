"""DiffusionGemma's ModelOpt NVFP4 experts: planned and validated from the safetensors headers,
loaded into `NVFP4Experts(activation="gelu_tanh")`, dequantized into `GemmaExperts` for
`precision="bf16"` (docs/nvfp4.md §1.4).

Checkpoint tensors of layer L, expert E, under `model.decoder.layers.L.experts` (or the tied
encoder's name `model.encoder.language_model.layers.L.experts` when an export uses that one):
- `E.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2, input_scale}` (ModelOpt's
  fused-experts export) fill buffers `{gate,up,down}_proj_{suffix}[E]`;
- or `E.gate_up_proj.*` (rows `:I` gate, `I:` up; its `weight_scale_2` and `input_scale` serve
  both) with `E.down_proj.*`.
`input_scale` may be absent (1.0; only W4A4 emulation reads it). Every routed expert must be
quantized in the quantization config, whatever tensors are present; the BF16 copies
(`...experts.gate_up_proj`, `...experts.down_proj`) are never read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dlmc.errors import CheckpointError
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.weights import progress_bar
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig
from dlmc.models.diffusion_gemma_moe import GemmaExperts
from dlmc.models.nvfp4_experts import NVFP4Experts
from dlmc.quant.modelopt_config import QuantConfig
from dlmc.quant.validate import SAFETENSORS_DTYPES, TensorMeta, validate_nvfp4_linear

SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
PREFIXES = ("model.decoder.layers.{layer}.experts",
            "model.encoder.language_model.layers.{layer}.experts")
_LAYERS = r"^model\.(?:decoder|encoder\.language_model)\.layers\.\d+\.experts\."
# The unused BF16 stacks of a quantized export, skipped by name.
BF16_COPY_RE = re.compile(_LAYERS + r"(?:gate_up_proj|down_proj)$")
# Tensors of per-expert linears, quantized or not.
EXPERT_TENSOR_RE = re.compile(_LAYERS + r"\d+\.(?:gate_up_proj|gate_proj|up_proj|down_proj)\.")


@dataclass(frozen=True)
class ExpertSource:
    """One checkpoint linear of an expert and the projections whose rows it holds, in order."""

    module: str  # e.g. `model.decoder.layers.0.experts.3.gate_up_proj`
    projections: tuple[str, ...]  # ("gate_proj", "up_proj") for a fused gate_up


Plan = dict[int, list[tuple[ExpertSource, ...]]]  # layer -> expert -> its linears


def is_bf16_expert_copy(name: str) -> bool:
    """True for the stacked BF16 expert tensors that a quantized export keeps beside its
    NVFP4 experts."""
    return BF16_COPY_RE.match(name) is not None


def _meta(index: SafetensorsIndex, name: str) -> TensorMeta:
    info = index.tensors[name]
    if info.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{info.file.name}: tensor {name} has dtype {info.dtype}, which "
                              "an NVFP4 linear never has")
    return TensorMeta(SAFETENSORS_DTYPES[info.dtype], info.shape)


def _why_not_quantized(quant: QuantConfig) -> str:
    if quant.quant_algo == "MIXED_PRECISION":
        return "not listed in `quantized_layers`"
    return "matched by `exclude_modules`"


def _prefix(index: SafetensorsIndex) -> str:
    """The experts' prefix template: the decoder's name unless only the encoder's is used."""
    decoder = any(n.startswith("model.decoder.") and EXPERT_TENSOR_RE.match(n)
                  for n in index.tensors)
    encoder = any(n.startswith("model.encoder.") and EXPERT_TENSOR_RE.match(n)
                  for n in index.tensors)
    return PREFIXES[1] if encoder and not decoder else PREFIXES[0]


def _has_any(index: SafetensorsIndex, modules: tuple[str, ...]) -> bool:
    return any(f"{m}.{s}" in index for m in modules for s in SUFFIXES)


def _expert_sources(index: SafetensorsIndex, prefix: str, expert: int
                    ) -> tuple[ExpertSource, ...]:
    base = f"{prefix}.{expert}"
    down = ExpertSource(f"{base}.down_proj", ("down_proj",))
    fused, split = f"{base}.gate_up_proj", (f"{base}.gate_proj", f"{base}.up_proj")
    if _has_any(index, (fused,)):
        if _has_any(index, split):
            raise CheckpointError(
                f"{index.directory}: expert {base} has both a fused {fused}.* and split "
                f"{split[0]}.* / {split[1]}.* tensors; expected one form")
        return ExpertSource(fused, ("gate_proj", "up_proj")), down
    return (ExpertSource(split[0], ("gate_proj",)), ExpertSource(split[1], ("up_proj",)), down)


def _validate(index: SafetensorsIndex, quant: QuantConfig, source: ExpertSource, out_f: int,
              in_f: int, copy: str) -> None:
    if not quant.is_quantized(source.module):
        raise CheckpointError(
            f"{quant.source}: {source.module} is {_why_not_quantized(quant)}; dlmc runs "
            "DiffusionGemma's routed experts from NVFP4 tensors only (every expert quantized)")
    metas = {s: _meta(index, f"{source.module}.{s}") for s in SUFFIXES
             if f"{source.module}.{s}" in index}
    try:
        validate_nvfp4_linear(source.module, metas, out_f, in_f)
    except CheckpointError as exc:
        if copy not in index:
            raise
        raise CheckpointError(f"{exc}; the BF16 copy {copy} is never read in its place") from None


def plan_experts(index: SafetensorsIndex, config: DiffusionGemmaConfig, quant: QuantConfig,
                 ignore: Callable[[str], bool]) -> Plan:
    """Where every routed expert's NVFP4 tensors are, checked from the headers: each expert
    quantized in `quant` with valid tensors, and no other quantized (uint8) weight except in
    tensors `ignore` skips. Raises `CheckpointError` naming the tensor or config field."""
    for name, info in index.tensors.items():
        if info.dtype == "U8" and not EXPERT_TENSOR_RE.match(name) and not ignore(name):
            raise CheckpointError(
                f"{info.file.name}: {name} is quantized, but dlmc runs NVFP4 only for "
                "DiffusionGemma's routed experts (expected this module in exclude_modules)")
    template = _prefix(index)
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    plan: Plan = {}
    for layer in range(config.num_hidden_layers):
        prefix = template.format(layer=layer)
        plan[layer] = []
        for expert in range(config.num_experts):
            sources = _expert_sources(index, prefix, expert)
            for source in sources:
                down = source.projections == ("down_proj",)
                out_f = hidden if down else inter * len(source.projections)
                copy = f"{prefix}.{'down_proj' if down else 'gate_up_proj'}"
                _validate(index, quant, source, out_f, inter if down else hidden, copy)
            plan[layer].append(sources)
    return plan


def use_nvfp4_experts(model: DiffusionGemmaForBlockDiffusion, on_gpu: bool) -> None:
    """Replace every layer's experts by (meta-device) NVFP4 gelu-tanh experts; off the GPU they
    run the op's plain-PyTorch reference."""
    config = model.config
    for layer in model.model.decoder.layers:
        layer.experts = NVFP4Experts(config.num_experts, config.hidden_size,
                                     config.moe_intermediate_size, activation="gelu_tanh",
                                     use_reference=not on_gpu, device="meta")


@torch.no_grad()
def load_experts(model: DiffusionGemmaForBlockDiffusion, index: SafetensorsIndex, plan: Plan,
                 device: torch.device, show_progress: bool = False) -> set[str]:
    """Fill the NVFP4 experts' buffers from the planned tensors; returns the names read.
    Global and input scales must be finite and positive (an error names the tensor)."""
    used: set[str] = set()
    total = sum(len(experts) for experts in plan.values())
    with progress_bar(show_progress, total) as bar:
        task = bar.add_task("loading NVFP4 experts", total=total) if bar else None
        for layer, experts in plan.items():
            module = model.model.decoder.layers[layer].experts
            buffers = {n: torch.empty(b.shape, dtype=b.dtype, device=device)
                       for n, b in module.named_buffers()}
            for name, buffer in buffers.items():
                if name.endswith("_input_scale"):
                    buffer.fill_(1.0)  # absent: unused by W4A16
            for expert, sources in enumerate(experts):
                for source in sources:
                    used |= _copy_source(index, source, expert, buffers)
                if bar:
                    bar.advance(task)
            for name, buffer in buffers.items():
                module._buffers[name] = buffer
            _check_scales(experts, buffers)
    return used


def _copy_source(index: SafetensorsIndex, source: ExpertSource, expert: int,
                 buffers: dict[str, torch.Tensor]) -> set[str]:
    read = set()
    parts = len(source.projections)
    for suffix in SUFFIXES:
        name = f"{source.module}.{suffix}"
        if name not in index:  # only input_scale may be absent (validated)
            continue
        tensor = index.get(name)
        read.add(name)
        if suffix in ("weight", "weight_scale"):
            chunks = tensor.chunk(parts, dim=0)  # [out / parts, ...] rows of each projection
        else:
            chunks = (tensor.reshape(()),) * parts
        for proj, chunk in zip(source.projections, chunks, strict=True):
            buffers[f"{proj}_{suffix}"][expert].copy_(chunk)
    return read


def _check_scales(experts: list[tuple[ExpertSource, ...]], buffers: dict[str, torch.Tensor]
                  ) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for suffix in ("weight_scale_2", "input_scale"):
            values = buffers[f"{proj}_{suffix}"].float()  # [E]
            bad = torch.nonzero(~(torch.isfinite(values) & (values > 0))).flatten()
            if bad.numel():
                expert = int(bad[0])
                module = next(s.module for s in experts[expert] if proj in s.projections)
                value = float(values[expert])
                raise CheckpointError(f"{module}.{suffix}: expected a finite positive scale, "
                                      f"got {value if math.isfinite(value) else str(value)}")


def prepare_experts_for_kernel(model: nn.Module) -> None:
    """precision="nvfp4": each NVFP4 experts module in the op kernel's load-time form."""
    for module in model.modules():
        if isinstance(module, NVFP4Experts):
            module.prepare_for_kernel()


@torch.no_grad()
def dequantize_experts(model: DiffusionGemmaForBlockDiffusion, dtype: torch.dtype) -> None:
    """precision="bf16": every layer's NVFP4 experts -> `GemmaExperts` with the exactly
    dequantized weights (`NVFP4Experts.dequantize_to_bf16`) in its fused layout, gate rows then
    up rows of `gate_up_proj`; one layer at a time."""
    config = model.config
    for layer in model.model.decoder.layers:
        if not isinstance(layer.experts, NVFP4Experts):
            continue
        weights = layer.experts.dequantize_to_bf16()  # {proj: [E, out, in]}
        with torch.device("meta"):
            dense = GemmaExperts(config.num_experts, config.hidden_size,
                                 config.moe_intermediate_size)
        gate_up = torch.cat([weights.pop("gate_proj"), weights.pop("up_proj")], dim=1)  # [E,2I,H]
        dense.gate_up_proj = nn.Parameter(gate_up.to(dtype), requires_grad=False)
        dense.down_proj = nn.Parameter(weights.pop("down_proj").to(dtype), requires_grad=False)
        layer.experts = dense
