"""dlmc::bf16_moe with `activation="gelu_tanh"` over DiffusionGemma's fused gate_up layout: the
halves `gate_up_proj[:, :I]`, `gate_up_proj[:, I:]` of one `[E, 2I, H]` tensor, read in place.

Against `bf16_moe_reference` and `grouped_gelu_moe` (the model's `torch._grouped_mm` path). All
three round g and u to bf16, gelu-tanh(g) to bf16, `h` to bf16 and each expert's output to bf16,
then weight and sum in fp32. They differ in the order of the fp32 sums inside each dot product
and in the gelu's last fp32 bit (the interpreter computes `1 + tanh(z)` as `2 * sigmoid(2z)`),
so a few values round to the neighbouring bf16 (one step is 2^-8 relative): the outputs agree to
a relative norm of 1e-2 (bf16 agreement, as the SiLU test's bound) and most values are equal.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.bf16_moe import bf16_moe, bf16_moe_reference
from dlmc.models.diffusion_gemma_moe import grouped_gelu_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, experts, hidden, inter, top_k, seed):
    """x, ids, w, the fused gate_up `[E, 2I, H]` and down `[E, H, I]`, bf16 on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x, ids, w, gate_up, down)]


def _halves(gate_up):
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]  # views, expert stride 2I*H


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _check(x, ids, w, gate_up, down):
    gate, up = _halves(gate_up)
    got = bf16_moe(x, ids, w, gate, up, down, activation="gelu_tanh")
    want = bf16_moe_reference(x, ids, w, gate, up, down, activation="gelu_tanh")
    model = grouped_gelu_moe(x, ids, w, gate_up, down)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.isfinite(got.float()).all()
    for other in (want, model):
        assert _rel(got, other) < 1e-2
        assert (got == other).float().mean().item() > 0.5  # not merely close: mostly equal
    return got


@pytest.mark.parametrize(("tokens", "experts", "hidden", "inter", "top_k"),
                         [(64, 4, 200, 72, 4), (40, 8, 136, 40, 3), (24, 6, 72, 88, 2)])
def test_fused_halves_match_reference_and_grouped_mm(tokens, experts, hidden, inter, top_k):
    """Many pairs per expert (several M-blocks each), H and I not multiples of the tiles."""
    _check(*_case(tokens, experts, hidden, inter, top_k, seed=tokens))


@settings(max_examples=4 if DEVICE == "cpu" else 100, deadline=None)
@given(tokens=st.sampled_from([1, 5, 24, 48]), experts=st.sampled_from([4, 8]),
       hidden=st.sampled_from([32, 72]), inter=st.sampled_from([16, 40]),
       top_k=st.sampled_from([2, 4]), seed=st.integers(0, 1000))
def test_matches_reference_over_shapes(tokens, experts, hidden, inter, top_k, seed):
    _check(*_case(tokens, experts, hidden, inter, top_k, seed))


def test_halves_in_place_equal_contiguous_copies_and_differ_from_silu():
    """Reading the fused tensor's halves in place is bit for bit the contiguous stacks' result;
    the activation argument is not ignored."""
    x, ids, w, gate_up, down = _case(32, 4, 48, 24, 2, seed=5)
    gate, up = _halves(gate_up)
    in_place = bf16_moe(x, ids, w, gate, up, down, activation="gelu_tanh")
    copied = bf16_moe(x, ids, w, gate.contiguous(), up.contiguous(), down,
                      activation="gelu_tanh")
    assert torch.equal(in_place, copied)
    silu = bf16_moe(x, ids, w, gate, up, down)
    assert _rel(silu, bf16_moe_reference(x, ids, w, gate, up, down)) < 1e-2
    assert _rel(silu, in_place) > 0.1


def test_opcheck_with_gelu_and_the_fused_halves():
    x, ids, w, gate_up, down = _case(3, 4, 32, 16, 2, seed=1)
    torch.library.opcheck(torch.ops.dlmc.bf16_moe.default,
                          (x, ids, w.float(), *_halves(gate_up), down, False, "gelu_tanh"),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_activation_and_layouts_are_named():
    x, ids, w, gate_up, down = _case(3, 4, 32, 16, 2, seed=1)
    gate, up = _halves(gate_up)
    with pytest.raises(ValueError, match="bf16_moe: activation='gelu'.*silu, gelu_tanh"):
        bf16_moe(x, ids, w, gate, up, down, activation="gelu")
    with pytest.raises(ValueError, match="bf16_moe: activation='relu'"):
        bf16_moe_reference(x, ids, w, gate, up, down, activation="relu")
    with pytest.raises(ValueError, match=r"gate_proj must have row-major \[I, H\] expert blocks"):
        bf16_moe(x, ids, w, gate.transpose(1, 2).contiguous().transpose(1, 2), up, down)
    with pytest.raises(ValueError, match="same expert stride, got 512 / 1024"):
        bf16_moe(x, ids, w, gate.contiguous(), up, down)
    with pytest.raises(ValueError, match=r"gate_proj and up_proj must both be \[E, I, H=32\]"):
        bf16_moe(x, ids, w, gate, gate_up, down)
    with pytest.raises(ValueError, match=r"down_proj must be contiguous bf16 \[E=4, H=32, I=16\]"):
        bf16_moe(x, ids, w, gate, up, down.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.gpu
def test_diffusiongemma_full_expert_shapes():
    """DiffusionGemma-26B-A4B's experts (H 2816, I 704, 128 experts) for a 256-token canvas,
    top-8: about 16 pairs per expert; then the compiled op (Inductor traces the kernels)."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, top_k = 128, 2816, 704, 256, 8
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().cuda()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen)
               * hidden**-0.5).bfloat16().cuda()
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16().cuda()
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].cuda()
    w = torch.rand(tokens, top_k, generator=gen).cuda()
    got = _check(x, ids, w, gate_up, down)
    fn = torch.compile(lambda *a: bf16_moe(*a, activation="gelu_tanh"), fullgraph=True)
    torch.testing.assert_close(fn(x, ids, w, *_halves(gate_up), down), got)
