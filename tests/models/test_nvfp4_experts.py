"""NVFP4Experts: buffers named after the HF tensors, op vs reference, exact BF16 dequantization."""

from __future__ import annotations

import pytest
import torch

from dlmc.models.nvfp4_experts import NVFP4Experts, expert_buffer_target
from dlmc.quant.nvfp4_format import quantize_nvfp4

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
E, H, I = 4, 32, 48


def filled_experts(hidden: int = H, inter: int = I) -> tuple[NVFP4Experts, dict[str, torch.Tensor]]:
    """Quantize random BF16 experts and stack them as the loader does."""
    gen = torch.Generator().manual_seed(0)
    H, I = hidden, inter  # noqa: N806 (the module's names)
    experts = NVFP4Experts(E, H, I)
    bf16 = {}
    for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        weights = torch.randn(E, *shape, generator=gen).bfloat16() * 0.1
        bf16[proj] = weights
        for e in range(E):
            packed, block_scale, scale_2 = quantize_nvfp4(weights[e])
            getattr(experts, f"{proj}_weight")[e] = packed
            getattr(experts, f"{proj}_weight_scale")[e] = block_scale
            getattr(experts, f"{proj}_weight_scale_2")[e] = scale_2
        getattr(experts, f"{proj}_input_scale").fill_(0.002)
    return experts, bf16


def test_buffer_names_and_shapes() -> None:
    buffers = {n: (tuple(b.shape), b.dtype) for n, b in NVFP4Experts(E, H, I).named_buffers()}
    assert buffers["gate_proj_weight"] == ((E, I, H // 2), torch.uint8)
    assert buffers["down_proj_weight"] == ((E, H, I // 2), torch.uint8)
    assert buffers["up_proj_weight_scale"] == ((E, I, H // 16), torch.float8_e4m3fn)
    assert buffers["down_proj_weight_scale_2"] == ((E,), torch.float32)
    assert buffers["gate_proj_input_scale"] == ((E,), torch.float32)
    assert len(buffers) == 12
    with pytest.raises(ValueError, match="intermediate_size=40"):
        NVFP4Experts(E, H, 40)


def test_forward_op_matches_reference_and_bf16_maths() -> None:
    experts, _ = filled_experts()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen)
    out = experts(x, ids, weights)
    experts.use_reference = True
    ref = experts(x, ids, weights)
    scale = ref.float().abs().max()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * float(scale))
    # Independent BF16 SwiGLU over the dequantized weights (bf16 rounding of W differs slightly).
    deq = experts.dequantize_to_bf16()
    naive = torch.zeros(6, H)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            xt = x[t].float()
            g = deq["gate_proj"][e].float() @ xt
            u = deq["up_proj"][e].float() @ xt
            y = deq["down_proj"][e].float() @ (torch.nn.functional.silu(g) * u).bfloat16().float()
            naive[t] += weights[t, k] * y.bfloat16().float()
    torch.testing.assert_close(ref.float(), naive, rtol=0.02, atol=0.02 * float(scale))
    experts.emulate_w4a4 = True
    w4a4 = experts(x, ids, weights)
    assert not torch.equal(w4a4, ref)
    torch.testing.assert_close(w4a4.float(), ref.float(), rtol=0.3, atol=0.3 * float(scale))


def test_gelu_tanh_experts_are_diffusion_gemmas() -> None:
    """activation="gelu_tanh" (DiffusionGemma): the op equals the reference up to the fp32 sum
    order, and the reference is `GemmaExperts` over the exactly dequantized weights in its fused
    layout, up to the op's bf16 rounding of the intermediates; a shared (SwiGLU) expert and an
    unknown activation are refused."""
    from dlmc.models.diffusion_gemma_moe import GemmaExperts

    experts, _ = filled_experts()
    experts.activation = "gelu_tanh"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen)
    out = experts(x, ids, weights)
    experts.use_reference = True
    ref = experts(x, ids, weights)
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * scale)
    deq = experts.dequantize_to_bf16()
    dense = GemmaExperts(E, H, I)
    dense.gate_up_proj.data = torch.cat([deq["gate_proj"], deq["up_proj"]], dim=1).float()
    dense.down_proj.data = deq["down_proj"].float()
    want = dense(x.float(), ids, weights)  # [6, H] fp32
    got = experts(x.float(), ids, weights)
    assert got.dtype == torch.float32  # x's dtype
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * scale)
    experts.activation = "silu"
    assert (experts(x.float(), ids, weights) - want).abs().max() > 0.1 * scale
    experts.activation = "gelu_tanh"
    with pytest.raises(ValueError, match="shared expert is a SwiGLU MLP"):
        experts.set_shared_expert(torch.zeros(I, H), torch.zeros(I, H), torch.zeros(H, I))
    with pytest.raises(ValueError, match="activation='relu', expected one of"):
        NVFP4Experts(E, H, I, activation="relu")


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                    dtype=torch.float64)


def test_dequantize_to_bf16_is_exact() -> None:
    """Each weight is `e2m1(code) * block_scale * weight_scale_2` rounded once to bf16,
    computed here from the stored bytes in fp64 (where the product is exact), independently of
    the library's decoding; and it is the original weight within NVFP4's quantization error."""
    experts, bf16 = filled_experts()
    deq = experts.dequantize_to_bf16()
    for proj, original in bf16.items():
        assert deq[proj].dtype == torch.bfloat16 and deq[proj].shape == original.shape
        packed = getattr(experts, f"{proj}_weight")  # uint8 [E, N, K/2], low nibble first
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # [E, N, K]
        block = getattr(experts, f"{proj}_weight_scale").double().repeat_interleave(16, dim=-1)
        scale_2 = getattr(experts, f"{proj}_weight_scale_2").double()[:, None, None]
        expected = (E2M1[codes] * block * scale_2).to(torch.bfloat16)
        assert torch.equal(deq[proj], expected)
        error = (deq[proj].float() - original.float()).norm() / original.float().norm()
        assert 0 < error < 0.15  # 4-bit codes: a few percent, never exact


def test_expert_buffer_target() -> None:
    name = "model.layers.3.mlp.experts.17.gate_proj.weight_scale_2"
    assert expert_buffer_target(name) == (3, 17, "gate_proj_weight_scale_2")
    assert expert_buffer_target("model.layers.3.mlp.experts.1.down_proj.weight") == (
        3, 1, "down_proj_weight")
    assert expert_buffer_target("model.layers.3.mlp.shared_experts.gate_proj.weight") is None
    assert expert_buffer_target("model.layers.3.mlp.experts.1.down_proj.weight_bf16") is None
    assert all(expert_buffer_target(f"model.layers.0.mlp.experts.0.{n.replace('proj_', 'proj.')}")
               for n, _ in NVFP4Experts(E, H, I).named_buffers())


def test_compiles_fullgraph() -> None:
    experts, _ = filled_experts()
    x = torch.randn(3, H).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    weights = torch.rand(3, 2)
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, ids, weights), experts(x, ids, weights), rtol=0, atol=0)


def test_prepare_for_kernel_packs_weight_words() -> None:
    """Kernel v7's forms where the shapes take its layout: int32 weight words and tiled int8
    scale codes, the checkpoint's forms freed, forward bit for bit kernel v3's, the reference
    and exact dequantization unchanged; shapes the layout cannot take (v3) and the reference
    path keep the checkpoint's forms."""
    from tests.custom_ops.nvfp4_cases import kernel_v3

    assert not filled_experts()[0].prepare_for_kernel()  # 32 x 48: v3 reads E4M3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    experts, _ = filled_experts(128, 128)
    with kernel_v3():
        v3, deq = experts(x, ids, weights), experts.dequantize_to_bf16()
    experts.use_reference = True
    ref = experts(x, ids, weights)
    assert not experts.prepare_for_kernel()  # the reference path keeps E4M3
    experts.use_reference = False
    assert experts.prepare_for_kernel()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        weight = getattr(experts, f"{proj}_weight")
        assert weight.dtype == torch.int32
        assert weight.shape[-1] == 128 // 8
        assert getattr(experts, f"{proj}_weight_scale").dtype == torch.int8  # tiled codes
    assert sum(b.dtype == torch.float8_e4m3fn for b in experts.buffers()) == 0
    assert torch.equal(experts(x, ids, weights), v3)
    for proj, tensor in experts.dequantize_to_bf16().items():
        assert torch.equal(tensor, deq[proj])
    assert experts.prepare_for_kernel()  # idempotent
    assert torch.equal(experts(x, ids, weights), v3)
    experts.use_reference = True
    assert torch.equal(experts(x, ids, weights), ref)


@pytest.mark.parametrize(("inter", "activation", "tokens"),
                         [(80, "gelu_tanh", 7), (16, "silu", 3), (144, "gelu_tanh", 12)])
def test_pad_to_layout_takes_kernel_v7_with_the_same_outputs(inter: int, activation: str,
                                                            tokens: int) -> None:
    """A width the layout cannot take (H 128, I 80 / 16 / 144): widened to the next multiple
    of 128 with zero units, kernel
    v7's forms, the op's output (gelu-tanh, DiffusionGemma's) and the exact dequantization the
    unpadded module's bit for bit, the reference's up to its fp32 sums; once only; nothing for
    shapes v7 already takes or the reference path; `KernelConfig.nvfp4_pad_experts` applies
    it."""
    from dlmc.custom_ops.kernel_config import KernelConfig
    from dlmc.models.nvfp4_experts import apply_kernel_config

    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, 128, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    experts, _ = filled_experts(128, inter)
    experts.activation = activation
    padded = -(-inter // 128) * 128
    v3, deq = experts(x, ids, weights), experts.dequantize_to_bf16()
    experts.use_reference = True
    ref = experts(x, ids, weights)
    assert not experts.pad_to_layout()  # the reference path keeps the checkpoint's forms
    experts.use_reference = False
    apply_kernel_config(torch.nn.ModuleList([experts]), KernelConfig(nvfp4_pad_experts=True))
    assert (experts.intermediate_size, experts.checkpoint_intermediate_size) == (padded, inter)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(experts, f"{proj}_weight").dtype == torch.int32  # v7's words
    assert experts.gate_proj_weight.shape == (E, padded, 128 // 8)
    assert experts.down_proj_weight.shape == (E, 128, padded // 8)
    out = experts(x, ids, weights)
    assert torch.equal(out, v3) and out.abs().max() > 0
    for proj, tensor in experts.dequantize_to_bf16().items():
        assert torch.equal(tensor, deq[proj])
    assert not experts.pad_to_layout()  # already a multiple of 128
    experts.use_reference = True
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(experts(x, ids, weights).float(), ref.float(), rtol=2**-7,
                               atol=2**-7 * scale)
    square, _ = filled_experts(128, 128)
    assert not square.pad_to_layout()  # v7 already


def test_kernel_config_tiles_reach_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KernelConfig.nvfp4_tiles` changes the op's own tiles for each call's shape (here v7's
    at 128 x 128: 16-slot blocks, 128-wide tiles) and the op runs with them: the reference's
    output up to its fp32 sums, eager and compiled alike; empty passes no tiles."""
    import dlmc.models.nvfp4_experts as module
    from dlmc.custom_ops.kernel_config import KernelConfig
    from dlmc.custom_ops.nvfp4_moe_tiles import NVFP4Tiles
    from dlmc.models.nvfp4_experts import apply_kernel_config

    experts, _ = filled_experts(128, 128)
    assert experts.prepare_for_kernel()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    seen = []
    op = module.nvfp4_moe
    monkeypatch.setattr(module, "nvfp4_moe",
                        lambda *a, **kw: seen.append(kw.get("tiles")) or op(*a, **kw))
    default = experts(x, ids, weights)
    apply_kernel_config(torch.nn.ModuleList([experts]),
                        KernelConfig(nvfp4_tiles="block_m=32,gate_up_warps=8"))
    assert experts.tiles == "block_m=32,gate_up_warps=8"
    tiled = experts(x, ids, weights)
    assert seen == [None, NVFP4Tiles(block_m=32, gate_up_block_n=128, gate_up_block_k=128,
                                     down_block_n=128, down_block_k=128, gate_up_warps=8)]
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, ids, weights), tiled)
    experts.use_reference = True
    ref = experts(x, ids, weights)
    scale = float(ref.float().abs().max())
    for out in (default, tiled):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7 * scale)
