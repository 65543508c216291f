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

from dlmc.custom_ops.qk_norm_rope import (
    kernel_takes_qkv,
    qk_norm_rope,
    qk_norm_rope_reference,
    qkv_partials_sum,
)
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
    with pytest.raises(ValueError, match=r"or fp32 partials \[S, T, 128\], got torch.float32"):
        qk_norm_rope(qkv.float(), q_w, k_w, cos, sin, nq, nkv, eps)  # fp32 needs [S, T, W]
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(2, 3, 128\)"):
        qk_norm_rope(qkv.expand(2, 3, 128), q_w, k_w, cos, sin, nq, nkv, eps)
    with pytest.raises(ValueError, match="cos/sin must be"):
        qk_norm_rope(qkv, q_w, k_w, cos[:, :3], sin[:, :3], nq, nkv, eps)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope(torch.zeros(3, 96, dtype=BF16, device=DEVICE), q_w[:12], k_w[:12],
                     cos, sin, nq, nkv, eps)


def make_partials(case: tuple, splits: int, seed: int) -> torch.Tensor:
    """fp32 partials `[S, T, W]` that sum to about `case`'s qkv (split-K's output), with
    sums that land between bf16 values so that rounding the sum matters."""
    qkv = case[0].float().cpu()
    gen = torch.Generator().manual_seed(seed)
    parts = torch.randn((splits, *qkv.shape), generator=gen) * qkv.abs().mean() / 4
    parts[0] += qkv - parts.sum(0)
    return parts.to(DEVICE)


@settings(max_examples=6, deadline=None)
@given(splits=st.sampled_from([1, 2, 4]), tokens=st.sampled_from([1, 5, 17]),
       head_dim=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_split_k_partials_read_as_their_rounded_sum(splits: int, tokens: int, head_dim: int,
                                                    seed: int) -> None:
    """qkv as `dlmc::split_k_linear`'s fp32 partials: the same q, k, v bit for bit as the bf16
    rounding of their in-order sum (`qkv_partials_sum`), and the reference's maths."""
    case = make_case(tokens, 4, 2, head_dim, head_dim // 2, 1.0, seed)
    parts = make_partials(case, splits, seed)
    rounded = qkv_partials_sum(parts)
    assert rounded.dtype == BF16 and rounded.shape == case[0].shape
    got = qk_norm_rope(parts, *case[1:])
    for g, w in zip(got, qk_norm_rope(rounded, *case[1:]), strict=True):
        assert torch.equal(g, w)
    for g, w in zip(got, qk_norm_rope_reference(parts, *case[1:]), strict=True):
        assert_close_heads(g, w)


def test_kernel_forms_of_qkv() -> None:
    """The kernels take bf16 `[T, W]` and fp32 partials `[S, T, W]`; an fp32 model's `[T, W]`
    (and a bf16 3-D tensor) goes to the reference maths instead (the model asks this)."""
    assert kernel_takes_qkv(torch.zeros(3, 8, dtype=BF16))
    assert kernel_takes_qkv(torch.zeros(2, 3, 8))
    assert not kernel_takes_qkv(torch.zeros(3, 8))
    assert not kernel_takes_qkv(torch.zeros(2, 3, 8, dtype=BF16))
    assert not kernel_takes_qkv(torch.zeros(0, 3, 8))


def test_partials_sum_in_order() -> None:
    """`qkv_partials_sum` adds s = 0, 1, ... in fp32 and rounds once: 1 + 2^-24 + 2^-24 is 1 in
    that order (each add rounds back to 1) where another order would give 1 + 2^-23."""
    parts = torch.tensor([[[1.0]], [[2.0**-24]], [[2.0**-24]]])
    assert qkv_partials_sum(parts).item() == 1.0
    big = torch.tensor([[[1.0 + 2.0**-8]], [[2.0**-9]]])  # 1 + 3·2^-9: rounds to 1 + 2^-7
    assert qkv_partials_sum(big).item() == 1.0 + 2.0**-7


def test_opcheck() -> None:
    qkv, q_w, k_w, cos, sin, nq, nkv, eps = make_case(3, 4, 2, 16, 8, 1.0, 1)
    for x in (qkv, make_partials((qkv,), 3, 1)):
        torch.library.opcheck(torch.ops.dlmc.qk_norm_rope.default,
                              (x, q_w, k_w, cos, sin, nq, nkv, eps),
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
