"""dlmc::qk_norm_rope_append: qk_norm_rope's outputs, and the cache `kv_append` would write.

q, k, v are compared with the reference as in test_qk_norm_rope.py (one bf16 step at most,
almost all bit-exact); the cache must hold, bit for bit, what `kv_append_reference` stores for
the op's own k and v, and nothing else may change. On CPU the kernel runs under Triton's
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.kv_append import kv_append_reference
from dlmc.custom_ops.qk_norm_rope import qk_norm_rope_reference, qkv_partials_sum
from dlmc.custom_ops.qk_norm_rope_append import (
    qk_norm_rope_append,
    qk_norm_rope_append_reference,
)
from dlmc.errors import ConfigError

from .graph_capture import compile_and_capture
from .test_kv_append import as_bits
from .test_qk_norm_rope import assert_close_heads, make_case, make_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def make_cache(tokens: int, num_kv: int, head_dim: int, *, page_size: int, num_pages: int,
               table_len: int, offset: int, scales: tuple[float, float], dtype: torch.dtype,
               seed: int) -> tuple:
    """Stale pools `[num_pages, page_size, Hkv, D]`, a shuffled page table of `table_len`
    entries (past `num_pages`: page ids out of range, never read below the capacity), offset
    and scales: `qk_norm_rope_append`'s cache arguments."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, num_kv, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 4).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 4).to(dtype)
    table = torch.randperm(num_pages, generator=gen)
    padding = torch.arange(1000, 1000 + max(0, table_len - num_pages))
    table = torch.cat([table, padding])[:table_len]
    return tuple(t.to(DEVICE) for t in (
        k_cache, v_cache, table.to(torch.int32), torch.tensor([offset], dtype=torch.int32),
        torch.tensor([scales[0]]), torch.tensor([scales[1]])))


def assert_matches(case: tuple, cache: tuple) -> None:
    k_cache, v_cache, table, offset, k_scale, v_scale = cache
    k_want, v_want = k_cache.clone(), v_cache.clone()
    q, k, v = qk_norm_rope_append(*case, *cache)
    for got, want in zip((q, k, v), qk_norm_rope_reference(*case), strict=True):
        assert_close_heads(got, want)
    # written slots: kv_append of the op's own k/v, bit for bit; every other slot: unchanged
    kv_append_reference(k, v, k_want, v_want, table, offset, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(as_bits(k_cache), as_bits(k_want))
    assert torch.equal(as_bits(v_cache), as_bits(v_want))


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17]), num_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 4]), head_dim=st.sampled_from([16, 64, 128]),
       rotary_frac=st.sampled_from([0.0, 0.5, 1.0]), log_scale=st.floats(-6, 6),
       page_size=st.sampled_from([1, 4, 16]), offset=st.integers(0, 40),
       pages_short=st.sampled_from([0, 0, 1]), table_extra=st.sampled_from([-1, 0, 0, 2]),
       log_kv_scales=st.tuples(st.floats(-8, 4), st.floats(-8, 4)), fp8=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, num_kv: int, group: int, head_dim: int,
                           rotary_frac: float, log_scale: float, page_size: int, offset: int,
                           pages_short: int, table_extra: int,
                           log_kv_scales: tuple[float, float], fp8: bool, seed: int) -> None:
    """Awkward token counts and offsets across page boundaries; `pages_short` fewer pools
    than the block needs, or a page table one entry short (`table_extra` -1): positions past
    the capacity are dropped."""
    rotary = int(head_dim * rotary_frac) // 2 * 2
    case = make_case(tokens, group * num_kv, num_kv, head_dim, rotary, 2.0**log_scale, seed)
    num_pages = max(1, math.ceil((offset + tokens) / page_size) - pages_short)
    table_len = max(1, num_pages + table_extra)
    cache = make_cache(tokens, num_kv, head_dim, page_size=page_size, num_pages=num_pages,
                       table_len=table_len, offset=offset,
                       scales=(math.exp(log_kv_scales[0]), math.exp(log_kv_scales[1])),
                       dtype=FP8 if fp8 else torch.bfloat16, seed=seed)
    assert_matches(case, cache)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 3, 4, 30])
def test_page_boundaries_and_capacity(dtype: torch.dtype, offset: int) -> None:
    """17 tokens into 9 pages of 4 slots: offset 30 fills 6 slots and drops 11 tokens."""
    case = make_case(17, 4, 2, 64, 32, 1.0, offset)
    cache = make_cache(17, 2, 64, page_size=4, num_pages=9, table_len=9, offset=offset,
                       scales=(0.05, 2.0), dtype=dtype, seed=offset)
    before = cache[0].clone()
    assert_matches(case, cache)
    assert not torch.equal(as_bits(cache[0]), as_bits(before))


def test_fp8_saturates_and_matches_the_reference_op() -> None:
    """Scales small enough that the FP8 stores saturate at ±448; the op against
    `qk_norm_rope_append_reference` (outputs, then the caches as the reference fills them)."""
    case = make_case(3, 4, 2, 16, 8, 1.0, 5)
    cache = make_cache(3, 2, 16, page_size=4, num_pages=2, table_len=2, offset=2,
                       scales=(1e-3, 1e-4), dtype=FP8, seed=5)
    ref_cache = tuple(t.clone() for t in cache)
    got = qk_norm_rope_append(*case, *cache)
    want = qk_norm_rope_append_reference(*case, *ref_cache)
    for g, w in zip(got, want, strict=True):
        assert_close_heads(g, w)
    assert (cache[0].float().abs() == 448).any() and (cache[1].float().abs() == 448).any()
    assert torch.equal(as_bits(cache[1]), as_bits(ref_cache[1]))  # v is copied exactly


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
def test_split_k_partials_store_what_their_rounded_sum_stores(dtype: torch.dtype) -> None:
    """qkv as fp32 split-K partials `[4, T, W]`: outputs and caches bit for bit those of the
    bf16 rounding of their in-order sum."""
    case = make_case(17, 4, 2, 64, 32, 1.0, 9)
    parts = make_partials(case, 4, 9)
    cache = make_cache(17, 2, 64, page_size=4, num_pages=9, table_len=9, offset=5,
                       scales=(0.05, 2.0), dtype=dtype, seed=9)
    want_cache = tuple(t.clone() for t in cache)
    got = qk_norm_rope_append(parts, *case[1:], *cache)
    want = qk_norm_rope_append(qkv_partials_sum(parts), *case[1:], *want_cache)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(cache[:2], want_cache[:2], strict=True):
        assert torch.equal(as_bits(g), as_bits(w))
    assert_matches((parts, *case[1:]), make_cache(17, 2, 64, page_size=4, num_pages=9,
                                                  table_len=9, offset=5, scales=(0.05, 2.0),
                                                  dtype=dtype, seed=9))


def test_errors_name_the_tensor() -> None:
    case = make_case(3, 4, 2, 16, 8, 1.0, 0)
    cache = make_cache(3, 2, 16, page_size=4, num_pages=2, table_len=2, offset=0,
                       scales=(1.0, 1.0), dtype=FP8, seed=0)
    k_cache, v_cache, table, offset, k_scale, v_scale = cache
    with pytest.raises(ValueError, match=r"qk_norm_rope_append: qkv must be bf16 \[T, 128\]"):
        qk_norm_rope_append(case[0][:, :64], *case[1:], *cache)
    with pytest.raises(ValueError, match=r"qk_norm_rope_append: cos/sin must be \[T=3, R\]"):
        qk_norm_rope_append(*case[:3], case[3][:, :3], case[4][:, :3], *case[5:], *cache)
    with pytest.raises(ConfigError, match=r"qk_norm_rope_append: k_cache must be "
                                          r"\[num_pages, page_size, 2, 16\]"):
        qk_norm_rope_append(*case, k_cache[:, :, :1], v_cache, table, offset, k_scale, v_scale)
    with pytest.raises(ConfigError, match="qk_norm_rope_append: v_cache must match k_cache"):
        qk_norm_rope_append(*case, k_cache, v_cache.bfloat16(), table, offset, k_scale, v_scale)
    with pytest.raises(ConfigError, match="qk_norm_rope_append: page_table must be 1-D int32"):
        qk_norm_rope_append(*case, k_cache, v_cache, table.long(), offset, k_scale, v_scale)
    with pytest.raises(ConfigError, match="qk_norm_rope_append: offset must be a 1-element"):
        qk_norm_rope_append(*case, k_cache, v_cache, table, offset.long(), k_scale, v_scale)
    with pytest.raises(ConfigError, match="qk_norm_rope_append: v_scale must be a 1-element"):
        qk_norm_rope_append(*case, k_cache, v_cache, table, offset, k_scale, v_scale.repeat(2))


def test_opcheck() -> None:
    """BF16 pools: the schema check compares the mutated inputs with CPU ops FP8 lacks."""
    case = make_case(3, 4, 2, 16, 8, 1.0, 1)
    cache = make_cache(3, 2, 16, page_size=4, num_pages=2, table_len=2, offset=3,
                       scales=(0.5, 2.0), dtype=torch.bfloat16, seed=1)
    torch.library.opcheck(torch.ops.dlmc.qk_norm_rope_append.default, (*case, *cache),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
def test_compile_and_cuda_graph_replay(dtype: torch.dtype) -> None:
    """Compiled and captured once, replayed at other offsets (device tensor) and inputs: the
    outputs of qk_norm_rope and, accumulated over the replays, the caches kv_append fills."""
    case = make_case(32, 16, 4, 128, 64, 1.0, 2)
    cache = make_cache(32, 4, 128, page_size=16, num_pages=64, table_len=64, offset=0,
                       scales=(0.01, 0.02), dtype=dtype, seed=2)
    qkv, offset = case[0], cache[3]
    graph, out = compile_and_capture(lambda x: qk_norm_rope_append(x, *case[1:], *cache), qkv)
    k_want, v_want = cache[0].clone(), cache[1].clone()
    for step, start in enumerate((0, 32, 50, 1000)):
        qkv.copy_(make_case(32, 16, 4, 128, 64, 1.0, 10 + step)[0])
        offset.fill_(start)
        graph.replay()
        for got, want in zip(out, qk_norm_rope_reference(qkv, *case[1:]), strict=True):
            assert_close_heads(got, want)
        kv_append_reference(out[1], out[2], k_want, v_want, cache[2], offset,
                            k_scale=cache[4], v_scale=cache[5])
    assert torch.equal(as_bits(cache[0]), as_bits(k_want))
    assert torch.equal(as_bits(cache[1]), as_bits(v_want))
