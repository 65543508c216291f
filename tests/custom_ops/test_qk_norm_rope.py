"""dlmc::qk_norm_rope: the one-launch Triton kernel against the eager reference.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
The kernel rounds exactly where eager PyTorch does; only the fp32 sum of squares may add up in
another order, so outputs agree to one bf16 step (and almost always exactly).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from dlmc.models.layers import rope_cos_sin

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def make_case(tokens: int, num_q: int, num_kv: int, head_dim: int, rotary: int, scale: float,
              seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    width = (num_q + 2 * num_kv) * head_dim
    qkv = (torch.randn(tokens, width, generator=gen) * scale).to(BF16)
    q_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(BF16)
    k_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(BF16)
    positions = torch.randint(0, 30000, (tokens,), generator=gen)
    cos, sin = rope_cos_sin(positions, rotary, 600000.0, BF16)
    return tuple(t.to(DEVICE) for t in (qkv, q_w, k_w, cos, sin)) + (num_q, num_kv, 1e-6)


def assert_close_heads(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one bf16 step of the head's scale: a normalised value may round the other
    way (fp32 statistics in another order), and the rotation's sum `a + b` may cancel, so the
    step is that of the head's largest value, not of the (possibly tiny) output element."""
    assert got.shape == want.shape and got.dtype == BF16 and got.is_contiguous()
    g, w = got.float(), want.float()
    bound = 2**-7 * w.abs().amax(-1, keepdim=True) + 1e-30  # [T, H, 1]
    assert ((g - w).abs() <= bound).all(), (g - w).abs().max()
    assert (g == w).float().mean().item() > 0.95  # almost all bit-exact


def assert_matches(case: tuple) -> None:
    got = qk_norm_rope(*case)
    want = qk_norm_rope_reference(*case)
    for g, w in zip(got, want, strict=True):
        assert_close_heads(g, w)
    assert torch.equal(got[2], want[2])  # value heads are copied


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17]), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 4]), head_dim=st.sampled_from([16, 64, 128]),
       rotary_frac=st.sampled_from([0.0, 0.5, 1.0]), log_scale=st.floats(-6, 6),
       seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, num_kv: int, group: int, head_dim: int,
                           rotary_frac: float, log_scale: float, seed: int) -> None:
    rotary = int(head_dim * rotary_frac) // 2 * 2
    assert_matches(make_case(tokens, group * num_kv, num_kv, head_dim, rotary,
                             2.0**log_scale, seed))


def test_llada2_mini_head_shapes_mostly_bit_exact() -> None:
    case = make_case(32, 16, 4, 128, 64, 1.0, 0)
    got, want = qk_norm_rope(*case), qk_norm_rope_reference(*case)
    for g, w in zip(got, want, strict=True):
        assert (g != w).float().mean().item() < 0.01
    assert_matches(case)


def test_bad_shapes_name_the_tensor() -> None:
    qkv, q_w, k_w, cos, sin, nq, nkv, eps = make_case(3, 4, 2, 16, 8, 1.0, 0)
    with pytest.raises(ValueError, match=r"qkv must be bf16 \[T, 128\]"):
        qk_norm_rope(qkv[:, :64], q_w, k_w, cos, sin, nq, nkv, eps)
    with pytest.raises(ValueError, match="cos/sin must be"):
        qk_norm_rope(qkv, q_w, k_w, cos[:, :3], sin[:, :3], nq, nkv, eps)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope(torch.zeros(3, 96, dtype=BF16, device=DEVICE), q_w[:12], k_w[:12],
                     cos, sin, nq, nkv, eps)


def test_opcheck() -> None:
    qkv, q_w, k_w, cos, sin, nq, nkv, eps = make_case(3, 4, 2, 16, 8, 1.0, 1)
    torch.library.opcheck(torch.ops.dlmc.qk_norm_rope.default,
                          (qkv, q_w, k_w, cos, sin, nq, nkv, eps),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    case = make_case(32, 16, 4, 128, 64, 1.0, 2)
    qkv = case[0]
    graph, out = compile_and_capture(lambda x: qk_norm_rope(x, *case[1:]), qkv)
    for seed in range(3):
        qkv.copy_(make_case(32, 16, 4, 128, 64, 1.0, 10 + seed)[0])
        graph.replay()
        want = qk_norm_rope_reference(qkv, *case[1:])
        for g, w in zip(out, want, strict=True):
            assert_close_heads(g, w)
