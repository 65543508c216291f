import torch

from dlmc.models.layers import (
    RMSNorm,
    SwiGLUMLP,
    apply_partial_rope,
    fuse_gate_up_projections,
    rope_cos_sin,
)


def test_rmsnorm_uses_weight_as_is():
    norm = RMSNorm(4, eps=1e-6)
    norm.weight.data = torch.tensor([1.0, 2.0, 0.5, -1.0])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    rms = (x.pow(2).mean() + 1e-6).sqrt()
    torch.testing.assert_close(norm(x), x / rms * norm.weight)


def test_partial_rope_pairs_i_and_i_plus_half_and_leaves_the_rest():
    head_dim, rotary_dim, theta = 16, 8, 600000.0
    pos = torch.tensor([0, 3, 17])
    cos, sin = rope_cos_sin(pos, rotary_dim, theta, torch.float64)
    x = torch.randn(3, 2, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = apply_partial_rope(x, cos, sin)
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])
    half = rotary_dim // 2
    for t, p in enumerate(pos.tolist()):
        for i in range(half):
            angle = p * theta ** (-2 * i / rotary_dim)
            c, s = torch.tensor(angle).cos(), torch.tensor(angle).sin()
            a, b = x[t, :, i], x[t, :, i + half]
            # the tables are computed in fp32 (as the reference does): fp32-level agreement
            torch.testing.assert_close(y[t, :, i], a * c - b * s, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(y[t, :, i + half], b * c + a * s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        apply_partial_rope(x[:1], *rope_cos_sin(pos[:1], 8, theta, torch.float64)), x[:1]
    )


def test_fused_gate_up_equals_separate_projections_and_keeps_hf_names():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 48)
    x = torch.randn(5, 64)
    want = mlp(x)
    names = set(mlp.state_dict())
    assert fuse_gate_up_projections(torch.nn.Sequential(mlp)) == 1
    assert mlp.gate_up_weight.shape == (96, 64)
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
    assert names <= set(mlp.state_dict())  # HF names still there (views of the fused weight)
    # loading new weights through the HF names reaches the fused weight
    fresh = SwiGLUMLP(64, 48)
    mlp.load_state_dict(fresh.state_dict(), strict=False)
    torch.testing.assert_close(mlp(x), fresh(x), rtol=1e-6, atol=1e-6)
    mlp.fuse_gate_up()  # idempotent
    assert mlp.gate_up_weight.shape == (96, 64)


def test_fused_gate_up_compiles_with_fullgraph():
    torch.manual_seed(1)
    mlp = SwiGLUMLP(32, 16)
    x = torch.randn(4, 32)
    want = mlp(x)
    mlp.fuse_gate_up()
    compiled = torch.compile(mlp, fullgraph=True)
    torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
