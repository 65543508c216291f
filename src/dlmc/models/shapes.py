"""Full-size model shapes for benchmarks (random weights, no checkpoint needed)."""

from __future__ import annotations

import torch
from torch import nn

from dlmc.models.config import LLaDA2Config
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig, RopeParameters
from dlmc.models.llada2 import LLaDA2ForDiffusion
from dlmc.models.nvfp4_experts import NVFP4Experts

# LLaDA2.1-mini config.json values (docs/llada2.md §1).
LLADA21_MINI = LLaDA2Config(
    vocab_size=157184,
    hidden_size=2048,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=5120,
    moe_intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
    num_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
# DiffusionGemma-26B-A4B's text config.json values (docs/diffusiongemma.md §2): 5 sliding
# layers then one full layer, five times.
DIFFUSIONGEMMA_26B_A4B = DiffusionGemmaConfig(
    vocab_size=262144,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    layer_types=((SLIDING,) * 5 + (FULL,)) * 5,
    sliding_window=1024,
    sliding_rope=RopeParameters("default", 10_000.0),
    full_rope=RopeParameters("proportional", 1_000_000.0, partial_rotary_factor=0.25),
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    canvas_length=256,
    eos_token_ids=(1, 106),
)
SHAPES: dict[str, LLaDA2Config | DiffusionGemmaConfig] = {
    "llada2.1-mini": LLADA21_MINI, "diffusiongemma-26b-a4b": DIFFUSIONGEMMA_26B_A4B}


def build_random_model(
    config: LLaDA2Config | DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype,
    seed: int = 0, nvfp4_experts: bool = False,
) -> nn.Module:
    """The model of `config` with seeded random weights made directly on `device`
    (DiffusionGemma: its routed experts in NVFP4 with `nvfp4_experts`)."""
    if isinstance(config, DiffusionGemmaConfig):
        return build_random_diffusion_gemma(config, device, dtype, seed, nvfp4_experts)
    return build_random_llada2(config, device, dtype, seed)


@torch.no_grad()
def build_random_diffusion_gemma(
    config: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
    nvfp4_experts: bool = False,
) -> DiffusionGemmaForBlockDiffusion:
    """DiffusionGemma with seeded random weights made directly on `device` in `dtype` (never
    zeros): matrices N(0, fan_in^-1/2); vectors and scalars (norm weights, router scales,
    `per_expert_scale`, `layer_scalar`) N(1, 0.05), as a trained model's stay near one.

    `nvfp4_experts`: every layer's routed experts are `NVFP4Experts(activation="gelu_tanh")`
    made directly in NVFP4 (`fill_random_nvfp4`; no BF16 copy is ever allocated), in the op
    kernel's load-time form on CUDA, the op's reference elsewhere."""
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    if nvfp4_experts:
        for layer in model.model.decoder.layers:
            layer.experts = NVFP4Experts(
                config.num_experts, config.hidden_size, config.moe_intermediate_size,
                activation="gelu_tanh", use_reference=device.type != "cuda", device=device)
    for module in model.modules():
        if isinstance(module, NVFP4Experts):
            fill_random_nvfp4(module, gen)
            module.prepare_for_kernel()  # the load-time step (kernels v4-v7)
            continue
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            value = torch.empty(tensor.shape, device=device, dtype=dtype)
            if tensor.dim() >= 2:
                value.normal_(0.0, tensor.shape[-1] ** -0.5, generator=gen)
            else:
                value.normal_(1.0, 0.05, generator=gen)
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[name] = value
    return model.eval()


@torch.no_grad()
def build_random_llada2(
    config: LLaDA2Config, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> LLaDA2ForDiffusion:
    """LLaDA2 with seeded random weights made directly on `device` (never zeros)."""
    with torch.device("meta"):
        model = LLaDA2ForDiffusion(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fan_in = param.shape[-1]
            value = torch.empty(param.shape, device=device, dtype=dtype)
            if name == "weight" and param.dim() == 1:  # norms
                value.normal_(1.0, 0.05, generator=gen)
            else:
                value.normal_(0.0, fan_in**-0.5, generator=gen)
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        for name, buf in list(module.named_buffers(recurse=False)):
            if name == "weight":  # the router's (fp32): drawn like the parameters
                value = torch.empty(buf.shape, device=device, dtype=buf.dtype)
                module._buffers[name] = value.normal_(0.0, buf.shape[-1] ** -0.5, generator=gen)
            elif not buf.dtype.is_floating_point:  # integer buffers: zeros
                module._buffers[name] = torch.zeros(buf.shape, device=device, dtype=buf.dtype)
            else:
                module._buffers[name] = torch.randn(buf.shape, device=device, generator=gen) * 0.01
    return model.eval()


@torch.no_grad()
def fill_random_nvfp4(experts: NVFP4Experts, gen: torch.Generator) -> None:
    """Random E2M1 codes (uniform bytes), block scales U(0.5, 2) in E4M3, global scales 0.02
    (weights about N(0, 0.05)-sized), in the checkpoint's form (before `prepare_for_kernel`)."""
    for name, buf in experts.named_buffers():
        if buf.dtype == torch.uint8:
            buf.copy_(torch.randint(0, 256, buf.shape, device=buf.device, generator=gen,
                                    dtype=torch.uint8))
        elif buf.dtype == torch.float8_e4m3fn:
            scales = torch.rand(buf.shape, device=buf.device, generator=gen) * 1.5 + 0.5
            buf.copy_(scales.to(torch.float8_e4m3fn))
        elif name.endswith("weight_scale_2"):
            buf.fill_(0.02)


@torch.no_grad()
def use_random_nvfp4_experts(model: LLaDA2ForDiffusion, seed: int = 0) -> None:
    """Replace every MoE layer's experts by NVFP4 experts with random codes and scales."""
    from dlmc.models.moe import MoEBlock

    cfg = model.config
    device = model.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if not isinstance(module, MoEBlock):
            continue
        experts = NVFP4Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               device=device)
        fill_random_nvfp4(experts, gen)
        experts.prepare_for_kernel()  # the load-time step (kernels v4-v7)
        module.experts = experts
