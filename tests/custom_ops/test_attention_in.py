"""dlmc::attention_in(_append): input RMSNorm + qkv projection + q/k norm + RoPE (+ K/V store)
in one launch, against the separate ops' references and the separate ops themselves.

Tolerance (as test_qk_norm_rope.py's): q, k, v within one bf16 step of the head's largest
value (2^-7 of it) and almost all bit-exact. The kernel rounds exactly where the plain path
does; only fp32 sums in another order (the input norm's and q/k norms' sums of squares, the
dot products' accumulation) may round a bf16 value the other way. The cache must hold, bit for
bit, what `kv_append_reference` stores for the op's own k and v, and nothing else may change.
On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _attention_in_kernel as kernel_module
from dlmc.custom_ops.attention_in import (
    attention_in,
    attention_in_append,
    attention_in_append_reference,
    attention_in_reference,
    counters_for,
)
from dlmc.custom_ops.kv_append import kv_append_reference
from dlmc.custom_ops.qk_norm_rope import qk_norm_rope_reference, rms_norm
from dlmc.custom_ops.qk_norm_rope_append import qk_norm_rope_append
from dlmc.custom_ops.split_k_linear import split_k_linear
from dlmc.errors import ConfigError
from dlmc.models.layers import rope_cos_sin

from .graph_capture import compile_and_capture
from .test_kv_append import as_bits
from .test_qk_norm_rope import assert_close_heads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def make_case(tokens: int, hidden: int, num_q: int, num_kv: int, head_dim: int, rotary: int,
              scale: float, seed: int, start: int = 0) -> tuple:
    """`attention_in`'s arguments: a residual stream of `scale`, LLaDA2-like weights, the
    rope tables of positions `start ..`, fresh counters."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * scale).to(BF16)
    norm_w = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(BF16)
    qkv_w = (torch.randn((num_q + 2 * num_kv) * head_dim, hidden, generator=gen)
             * hidden**-0.5).to(BF16)
    q_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(BF16)
    k_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(BF16)
    cos, sin = rope_cos_sin(torch.arange(start, start + tokens), rotary, 600000.0, BF16)
    tensors = tuple(t.to(DEVICE) for t in (x, norm_w, qkv_w, q_w, k_w, cos, sin))
    return (*tensors, num_q, num_kv, 1e-6, 1e-6, counters_for(num_q, num_kv, DEVICE))


def make_cache(tokens: int, num_kv: int, head_dim: int, *, page_size: int, offset: int,
               pages_short: int, dtype: torch.dtype, seed: int) -> tuple:
    """Stale pools with just enough pages for positions `< offset + tokens` (`pages_short`
    fewer: the last tokens dropped), a shuffled page table, offset and scales."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = max(1, math.ceil((offset + tokens) / page_size) - pages_short)
    shape = (num_pages, page_size, num_kv, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 4).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 4).to(dtype)
    table = torch.randperm(num_pages, generator=gen).to(torch.int32)
    return tuple(t.to(DEVICE) for t in (
        k_cache, v_cache, table, torch.tensor([offset], dtype=torch.int32),
        torch.tensor([0.05]), torch.tensor([0.02])))


def assert_matches(case: tuple, cache: tuple | None = None) -> tuple:
    """The op against `attention_in_reference`; with `cache`, the append op, and the cache
    against `kv_append_reference` of the op's own k, v (bit for bit, other slots unchanged);
    the counters end zero. Returns the op's q, k, v."""
    if cache is None:
        got = attention_in(*case)
    else:
        want_cache = tuple(t.clone() for t in cache[:2])
        got = attention_in_append(*case, *cache)
        kv_append_reference(got[1], got[2], *want_cache, cache[2], cache[3],
                            k_scale=cache[4], v_scale=cache[5])
        for g, w in zip(cache[:2], want_cache, strict=True):
            assert torch.equal(as_bits(g), as_bits(w))
    for g, w in zip(got, attention_in_reference(*case), strict=True):
        assert_close_heads(g, w)
    assert not case[-1].any()
    return got


@settings(max_examples=8, deadline=None)
@given(tokens=st.sampled_from([8, 13, 32, 64]), hidden=st.sampled_from([64, 96, 256, 520]),
       num_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       head_dim=st.sampled_from([16, 64]), rotary_frac=st.sampled_from([0.0, 0.5, 1.0]),
       log_scale=st.floats(-4, 4), append=st.sampled_from([None, FP8, BF16]),
       page_size=st.sampled_from([1, 16]), offset=st.integers(0, 16384),
       pages_short=st.sampled_from([0, 0, 1]), seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, hidden: int, num_kv: int, group: int, head_dim: int,
                           rotary_frac: float, log_scale: float, append: torch.dtype | None,
                           page_size: int, offset: int, pages_short: int, seed: int) -> None:
    """Block sizes 8-64, hidden sizes with one to five K splits (a partial last block), prefixes
    of 0-16k positions across page boundaries, a pool short of the block's last page."""
    rotary = int(head_dim * rotary_frac) // 2 * 2
    case = make_case(tokens, hidden, group * num_kv, num_kv, head_dim, rotary,
                     2.0**log_scale, seed, start=offset)
    cache = None if append is None else make_cache(
        tokens, num_kv, head_dim, page_size=page_size, offset=offset,
        pages_short=pages_short, dtype=append, seed=seed)
    assert_matches(case, cache)


@pytest.mark.parametrize("dtype", [FP8, BF16])
def test_equals_the_separate_ops(dtype: torch.dtype) -> None:
    """The plain layer path as the model runs it on the GPU (input `rms_norm`,
    `split_k_linear`'s partials into `qk_norm_rope_append`): the same q, k, v within the
    tolerance, and each cache as `kv_append_reference` fills it from its own k, v."""
    case = make_case(17, 256, 4, 2, 64, 32, 1.0, 3, start=40)
    cache = make_cache(17, 2, 64, page_size=16, offset=40, pages_short=0, dtype=dtype, seed=3)
    plain_cache = tuple(t.clone() for t in cache)
    x, norm_w, qkv_w, *rest = case
    parts = split_k_linear(rms_norm(x, norm_w, case[9]), qkv_w)
    want = qk_norm_rope_append(parts, *rest[:4], case[7], case[8], case[10], *plain_cache)
    got = assert_matches(case, cache)
    for g, w in zip(got, want, strict=True):
        assert_close_heads(g, w)


@pytest.mark.parametrize("splits", [1, 3])
def test_other_split_counts(monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    """One K split (no counter) and an odd count (a partial last split)."""
    monkeypatch.setattr(kernel_module, "CONFIG", (splits, 32, 4, 2))
    assert_matches(make_case(9, 160, 2, 1, 32, 16, 1.0, splits))


def test_llada2_mini_shapes_with_the_fp8_cache() -> None:
    """LLaDA2.1-mini's layer: H 2048, 16 q / 4 kv heads of 128, rotary 64, 32 tokens."""
    case = make_case(32, 2048, 16, 4, 128, 64, 1.0, 0, start=1000)
    cache = make_cache(32, 4, 128, page_size=16, offset=1000, pages_short=0, dtype=FP8, seed=0)
    got = assert_matches(case, cache)
    for g, w in zip(got, attention_in_reference(*case), strict=True):
        assert (g != w).float().mean().item() < 0.01


def test_references_compose_the_separate_references() -> None:
    """`attention_in_append_reference` is `qk_norm_rope_reference` of the normed projection,
    then `kv_append_reference` (syncs)."""
    case = make_case(5, 64, 4, 2, 16, 8, 1.0, 4, start=3)
    cache = make_cache(5, 2, 16, page_size=4, offset=3, pages_short=0, dtype=FP8, seed=4)
    want_cache = tuple(t.clone() for t in cache)
    x, norm_w, qkv_w, q_w, k_w, cos, sin, nq, nkv, eps, qk_eps, _ = case
    qkv = (rms_norm(x, norm_w, eps).float() @ qkv_w.float().t()).to(BF16)
    want = qk_norm_rope_reference(qkv, q_w, k_w, cos, sin, nq, nkv, qk_eps)
    got = attention_in_append_reference(*case, *cache)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    kv_append_reference(want[1], want[2], *want_cache[:2], *want_cache[2:4],
                        k_scale=want_cache[4], v_scale=want_cache[5])
    assert torch.equal(as_bits(cache[0]), as_bits(want_cache[0]))


def test_errors_name_the_tensor() -> None:
    case = make_case(3, 64, 4, 2, 16, 8, 1.0, 0)
    cache = make_cache(3, 2, 16, page_size=4, offset=0, pages_short=0, dtype=FP8, seed=0)
    x, norm_w, qkv_w, *rest = case
    with pytest.raises(ValueError, match=r"attention_in: x must be bf16 \[T <= 64, H\]"):
        attention_in(x.float(), norm_w, qkv_w, *rest)
    with pytest.raises(ValueError, match=r"attention_in: x must be bf16"):
        attention_in(torch.zeros(65, 64, dtype=BF16, device=DEVICE), norm_w, qkv_w, *rest)
    with pytest.raises(ValueError, match=r"attention_in: qkv_weight must be bf16 \[128, 64\]"):
        attention_in(x, norm_w, qkv_w[:64], *rest)
    with pytest.raises(ValueError, match=r"attention_in: norm_weight must be \[64\]"):
        attention_in(x, norm_w[:32], qkv_w, *rest)
    with pytest.raises(ValueError, match="attention_in: counters must be int32"):
        attention_in(*case[:-1], case[-1][:4])
    with pytest.raises(ValueError, match=r"attention_in: cos/sin must be \[T=3, R\]"):
        attention_in(*case[:5], case[5][:, :3], case[6][:, :3], *case[7:])
    with pytest.raises(ConfigError, match="attention_in_append: v_cache must match k_cache"):
        attention_in_append(*case, cache[0], cache[1].to(BF16), *cache[2:])


def test_fake_shapes_and_schema() -> None:
    """The fake functions give the real ops' shapes; opcheck on BF16 pools (the schema check
    compares mutated inputs with CPU ops FP8 lacks)."""
    case = make_case(3, 64, 4, 2, 16, 8, 1.0, 1, start=3)
    cache = make_cache(3, 2, 16, page_size=4, offset=3, pages_short=0, dtype=BF16, seed=1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in case]
        for op in (torch.ops.dlmc.attention_in, torch.ops.dlmc.attention_in_append):
            args = fake + ([mode.from_tensor(t) for t in cache]
                           if op is torch.ops.dlmc.attention_in_append else [])
            q, k, v = op(*args)
            assert (q.shape, k.shape, v.shape) == ((3, 4, 16), (3, 2, 16), (3, 2, 16))
            assert q.dtype == k.dtype == v.dtype == BF16
    torch.library.opcheck(torch.ops.dlmc.attention_in.default, case,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.dlmc.attention_in_append.default, (*case, *cache),
                          test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph_equals_eager() -> None:
    """torch.compile(fullgraph=True) traces both ops without a graph break (on CPU the
    interpreted ops run opaque); the same q, k, v and cache bit for bit as eager."""
    case = make_case(9, 64, 4, 2, 16, 8, 1.0, 2, start=5)
    cache = make_cache(9, 2, 16, page_size=4, offset=5, pages_short=0, dtype=FP8, seed=2)
    eager_cache = tuple(t.clone() for t in cache)
    torch._dynamo.reset()
    compiled = torch.compile(attention_in_append, fullgraph=True, dynamic=False)
    got = compiled(*case, *cache)
    want = attention_in_append(*case, *eager_cache)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(cache[:2], eager_cache[:2], strict=True):
        assert torch.equal(as_bits(g), as_bits(w))
    compiled_plain = torch.compile(attention_in, fullgraph=True, dynamic=False)
    for g, w in zip(compiled_plain(*case), attention_in(*case), strict=True):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, BF16])
def test_compile_and_cuda_graph_replay(dtype: torch.dtype) -> None:
    """LLaDA2.1-mini's shapes compiled and captured once, replayed at other offsets (device
    tensor) and inputs: q, k, v as the reference's and, over the replays, the caches as
    kv_append fills them; the counters end zero after every replay."""
    case = make_case(32, 2048, 16, 4, 128, 64, 1.0, 2)
    cache = make_cache(32, 4, 128, page_size=16, offset=1024, pages_short=0, dtype=dtype,
                       seed=2)
    x, offset = case[0], cache[3]
    graph, out = compile_and_capture(lambda h: attention_in_append(h, *case[1:], *cache), x)
    k_want, v_want = cache[0].clone(), cache[1].clone()
    for step, start in enumerate((0, 32, 50, 1000)):
        x.copy_(make_case(32, 2048, 16, 4, 128, 64, 1.0, 10 + step)[0])
        offset.fill_(start)
        graph.replay()
        for got, want in zip(out, attention_in_reference(x, *case[1:]), strict=True):
            assert_close_heads(got, want)
        kv_append_reference(out[1], out[2], k_want, v_want, cache[2], offset,
                            k_scale=cache[4], v_scale=cache[5])
        assert not case[-1].any()
    assert torch.equal(as_bits(cache[0]), as_bits(k_want))
    assert torch.equal(as_bits(cache[1]), as_bits(v_want))
