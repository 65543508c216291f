"""`KernelConfig.gemma_bf16_experts` in DiffusionGemma: with "triton" the BF16 `GemmaExperts`
run `dlmc::bf16_moe(activation="gelu_tanh")` over the two halves of `gate_up_proj` (no copy)
and give the `torch._grouped_mm` path's output.

The tiny model's experts on CPU (the op under Triton's interpreter). Both paths round g, u,
gelu-tanh(g), h and each expert's output to bf16 and sum the weighted outputs in fp32; they
differ only in the order of fp32 sums and the gelu's last fp32 bit, so a few values round to
the neighbouring bf16: relative norm of the difference < 1e-2, as the op's own tests.
"""

import pytest
import torch

import dlmc.models.diffusion_gemma_moe as gemma_moe
from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.models.diffusion_gemma_moe import GemmaExperts
from dlmc.models.nvfp4_experts import apply_kernel_config
from tests.models.gemma_tiny import tiny_model

# CPU tensors take the op only under the interpreter (a GPU machine runs the op's own GPU tests)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU)")


def _count_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    op = gemma_moe.bf16_moe

    def counting(*args, **kwargs):
        calls.append({"args": args, **kwargs})
        return op(*args, **kwargs)

    monkeypatch.setattr(gemma_moe, "bf16_moe", counting)
    return calls


def _inputs(tokens, experts, top_k, hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, top_k, generator=gen)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_apply_kernel_config_sets_every_layer_experts():
    model = tiny_model(3, torch.bfloat16)
    experts = [m for m in model.modules() if isinstance(m, GemmaExperts)]
    assert len(experts) == model.config.num_hidden_layers
    assert all(e.kernel == "auto" for e in experts)  # built with the default
    apply_kernel_config(model, KernelConfig(gemma_bf16_experts="triton"))
    assert all(e.kernel == "triton" for e in experts)
    apply_kernel_config(model, KernelConfig(gemma_bf16_experts="grouped_mm"))
    assert all(e.kernel == "grouped_mm" for e in experts)


@torch.inference_mode()
def test_triton_experts_match_grouped_mm_and_read_gate_up_in_place(monkeypatch):
    """A layer of the tiny model (8 experts, top 2, H 64, I 24) with 48 tokens: about 12 pairs
    per expert. The op gets views of `gate_up_proj` (its storage, rows `:I` and `I:`)."""
    model = tiny_model(3, torch.bfloat16)
    experts = model.model.decoder.layers[1].experts
    cfg = model.config
    x, ids, w = _inputs(48, cfg.num_experts, cfg.top_k_experts, cfg.hidden_size)
    calls = _count_calls(monkeypatch)
    out = {}
    try:
        for kernels in (KernelConfig(gemma_bf16_experts="grouped_mm"),
                        KernelConfig(gemma_bf16_experts="triton")):
            apply_kernel_config(model, kernels)
            out[kernels.gemma_bf16_experts] = experts(x, ids, w)
    finally:
        apply_kernel_config(model, KernelConfig())
    assert len(calls) == 1 and calls[0]["activation"] == "gelu_tanh"
    gate, up = calls[0]["args"][3:5]
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    base = experts.gate_up_proj.data_ptr()
    assert gate.data_ptr() == base and up.data_ptr() == base + inter * hidden * 2
    assert gate.shape == up.shape == (cfg.num_experts, inter, hidden)
    got, want = out["triton"], out["grouped_mm"]
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _rel(got, want) < 1e-2
    assert (got == want).float().mean().item() > 0.5


@torch.inference_mode()
def test_auto_keeps_the_grouped_path_on_the_cpu(monkeypatch):
    """"auto" runs `dlmc::bf16_moe` on CUDA only: bf16 on the CPU (even under Triton's
    interpreter) stays on `grouped_gelu_moe`."""
    model = tiny_model(3, torch.bfloat16)
    experts = model.model.decoder.layers[0].experts
    assert experts.kernel == "auto"
    x, ids, w = _inputs(6, model.config.num_experts, 2, model.config.hidden_size)
    calls = _count_calls(monkeypatch)
    got = experts(x, ids, w)
    assert calls == []
    want = gemma_moe.grouped_gelu_moe(x, ids, w, experts.gate_up_proj, experts.down_proj)
    assert torch.equal(got, want)


@torch.inference_mode()
def test_other_dtypes_keep_the_grouped_path(monkeypatch):
    """fp32 experts (the CPU model's dtype) keep `grouped_gelu_moe` with the switch on."""
    model = tiny_model(3, torch.float32)
    experts = model.model.decoder.layers[0].experts
    experts.kernel = "triton"
    x, ids, w = _inputs(6, model.config.num_experts, 2, model.config.hidden_size)
    calls = _count_calls(monkeypatch)
    got = experts(x.float(), ids, w)
    assert calls == []
    want = gemma_moe.grouped_gelu_moe(x.float(), ids, w, experts.gate_up_proj,
                                      experts.down_proj)
    assert torch.equal(got, want)
