"""dlmc::bf16_moe against bf16_moe_reference (CPU: Triton interpreter on small shapes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.bf16_moe import bf16_moe, bf16_moe_reference
from dlmc.custom_ops.moe_align import append_shared_column

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, experts, hidden, inter, top_k, seed, used=None, shared=False):
    """x, ids, w over `experts` routed experts (the first `used` of them), stacked weights with
    one more expert (the shared one, last) if `shared`."""
    gen = torch.Generator().manual_seed(seed)
    pool, experts = used or experts, experts + shared
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate = (torch.randn(experts, inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    up = (torch.randn(experts, inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x, ids, w, gate, up, down)]


def _check(args, shared=False):
    got = bf16_moe(*args, shared_expert=shared).float()
    want = bf16_moe_reference(*args, shared_expert=shared).float()
    # The op rounds gate/up to bf16 before SiLU (like the bf16 reference matmuls do); the
    # reference's bf16 matmuls accumulate in a different order: bf16-level agreement.
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, err
    assert torch.isfinite(got).all()


@settings(max_examples=8 if DEVICE == "cpu" else 200, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17]), experts=st.sampled_from([4, 9]),
       hidden=st.sampled_from([32, 48]), inter=st.sampled_from([16, 40]),
       top_k=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000))
def test_matches_reference(tokens, experts, hidden, inter, top_k, seed):
    top_k = min(top_k, experts)
    _check(_case(tokens, experts, hidden, inter, top_k, seed))


def test_experts_without_tokens_and_odd_sizes():
    _check(_case(5, 12, 48, 24, 2, seed=3, used=3))  # experts 3..11 receive no token


@pytest.mark.parametrize("block_m", [32, 64])
def test_a_swept_block_m_gives_the_same_result(monkeypatch, block_m):
    """The bench's `_BLOCK_M` sweep (more rows per M-block than the routing would pick): the
    same sums in the same order per row, so the same bits as the op's own block_m."""
    import dlmc.custom_ops.bf16_moe as bf16_module

    args = _case(40, 6, 32, 40, 3, seed=5)  # 20 pairs per expert: block_m 16 by default
    want = bf16_moe(*args)
    monkeypatch.setattr(bf16_module, "_BLOCK_M", block_m)
    got = bf16_moe(*args)
    assert torch.equal(got, want)
    _check(args)


@settings(max_examples=8 if DEVICE == "cpu" else 200, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 33]), experts=st.sampled_from([4, 9, 12]),
       used=st.sampled_from([None, 3]), hidden=st.sampled_from([32, 48]),
       inter=st.sampled_from([16, 40]), top_k=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 1000))
def test_shared_expert_matches_reference_and_the_appended_column(tokens, experts, used, hidden,
                                                                 inter, top_k, seed):
    """`shared_expert=True` (expert E-1 for every token, weight 1, as a dense tail) against the
    reference, and bit for bit against today's fused routing: the [T, K+1] ids and weights with
    the shared column appended (same blocks, same fp32 combine)."""
    args = _case(tokens, experts, hidden, inter, top_k, seed, used=used, shared=True)
    _check(args, shared=True)
    x, ids, w, *weights = args
    appended = bf16_moe(x, append_shared_column(ids, experts), append_shared_column(w, 1.0),
                        *weights)
    assert torch.equal(bf16_moe(*args, shared_expert=True), appended)


@pytest.mark.parametrize("shared", [False, True])
def test_opcheck(shared):
    args = _case(3, 4, 32, 16, 2, seed=1, shared=shared)
    args[2] = args[2].float()
    torch.library.opcheck(torch.ops.dlmc.bf16_moe.default, (*args, shared),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_input_is_named():
    args = _case(3, 4, 32, 16, 2, seed=1)
    with pytest.raises(ValueError, match="bf16_moe: x must be bf16"):
        bf16_moe(args[0].float(), *args[1:])
    with pytest.raises(ValueError, match="down_proj must be contiguous bf16"):
        bf16_moe(*args[:5], args[5].float())


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_full_size_shape_and_graph_replay(shared):
    args = _case(32, 256, 2048, 512, 8, seed=0, shared=shared)
    _check(args, shared)
    fn = torch.compile(lambda *a: bf16_moe(*a, shared_expert=shared), fullgraph=True)
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    args[0].normal_()
    graph.replay()
    torch.testing.assert_close(out, bf16_moe(*args, shared_expert=shared))
