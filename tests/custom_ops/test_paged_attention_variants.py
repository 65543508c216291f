"""The launch variants of `dlmc::paged_attention`'s kernels against the reference.

Every named variant that perf/bench_paged_attention.py --sweep times, and a fuzz over each
variant option (interleaved splits with speculative tiles, flat merges, merge rows, BF16
partials, FP16 dots, own-loop stages, PDL), on CPU through Triton's interpreter and on the GPU
in a CUDA graph. PDL is a no-op in the interpreter; its code path compiles for sm_90 in
test_kernels_compile_sm90.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.paged_attention import (
    SWEEP_VARIANTS,
    PagedAttentionVariant,
    launch_paged_attention,
    paged_attention_reference,
)
from dlmc.errors import ConfigError

from .paged_attention_cases import DEVICE, FP8, assert_matches_reference, make_case

BF16 = torch.bfloat16
# (prefix, window, cache dtype): empty, one key, a page, a 64-key tile and one past it, several
# tiles per split (the interleaved loop after the speculative tiles), windows cutting a tile.
AWKWARD = ((0, None, FP8), (1, None, FP8), (16, None, BF16), (64, None, FP8), (65, 40, FP8),
           (200, None, BF16), (450, None, FP8), (450, 200, FP8))


@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))
def test_sweep_variant_matches_reference(name: str) -> None:
    for prefix, window, dtype in AWKWARD:
        case = make_case(num_queries=5, num_q_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, prefix=prefix, k_scale=0.05, v_scale=0.02, dtype=dtype,
                         seed=prefix)
        assert_matches_reference(case, SWEEP_VARIANTS[name], softmax_scale=0.125, window=window,
                                 num_splits=3)


@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))
def test_sweep_variant_clamps_prefix_to_capacity(name: str) -> None:
    case = make_case(num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=4,
                     prefix=70, spare_pages=0)
    case["prefix_len"].fill_(1000)  # past the table's 72 slots: reads stop at capacity
    assert_matches_reference(case, SWEEP_VARIANTS[name], softmax_scale=0.2, num_splits=2)


@pytest.mark.parametrize("name", [n for n, v in SWEEP_VARIANTS.items()
                                  if v.split_order == "interleaved"][:1])
def test_speculative_tiles_ignore_stale_page_ids(name: str) -> None:
    """Table entries past the prefix may hold anything: speculative reads clamp them."""
    case = make_case(num_queries=3, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                     prefix=40, spare_pages=20)
    live_pages = math.ceil(40 / 16)
    stale = torch.tensor([-7, 10**6], dtype=torch.int32, device=case["page_table"].device)
    case["page_table"][live_pages:] = stale.repeat(case["page_table"].numel())[
        :case["page_table"].numel() - live_pages]
    assert_matches_reference(case, SWEEP_VARIANTS[name], softmax_scale=0.125, num_splits=4)


@st.composite
def variants(draw: st.DrawFn) -> PagedAttentionVariant:
    """Any valid combination of the variant options (interleaving needs a flat merge)."""
    merge = draw(st.sampled_from(["chunked", "masked", "speculative"]))
    flat = merge != "chunked"
    interleaved = flat and draw(st.booleans())
    return PagedAttentionVariant(
        merge=merge, split_order="interleaved" if interleaved else "contiguous",
        speculative_tiles=draw(st.sampled_from([1, 2])) if interleaved else 1,
        merge_rows=draw(st.sampled_from([1, 2, 4, 16])) if flat else 1,
        partial_dtype=draw(st.sampled_from([torch.float32, BF16])),
        fp8_dot_f16=draw(st.booleans()), own_stages=draw(st.sampled_from([0, 1])),
        pdl=flat and draw(st.booleans()))


@settings(max_examples=25 if DEVICE == "cpu" else 5, deadline=None)
@given(
    variant=variants(), head_dim=st.sampled_from([128, 256, 512]),
    group=st.sampled_from([1, 2, 4]), num_kv_heads=st.sampled_from([1, 2]),
    num_queries=st.sampled_from([1, 3, 17, 32]), page_size=st.sampled_from([1, 5, 16]),
    prefix=st.integers(0, 300), log_scales=st.tuples(st.floats(-7, 7), st.floats(-7, 7)),
    window=st.one_of(st.none(), st.integers(1, 400)), fp8=st.booleans(),
    causal_block=st.sampled_from([None, 1, 4]), num_splits=st.sampled_from([1, 2, 7]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_variants_against_reference(
    variant: PagedAttentionVariant, head_dim: int, group: int, num_kv_heads: int,
    num_queries: int, page_size: int, prefix: int, log_scales: tuple[float, float],
    window: int | None, fp8: bool, causal_block: int | None, num_splits: int, seed: int,
) -> None:
    case = make_case(num_queries=num_queries, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     prefix=prefix, k_scale=math.exp(log_scales[0]),
                     v_scale=math.exp(log_scales[1]), dtype=FP8 if fp8 else BF16, seed=seed)
    assert_matches_reference(case, variant, softmax_scale=head_dim**-0.5, window=window,
                             causal_block=causal_block, num_splits=num_splits)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"split_order": "interleaved"}, "split_order='interleaved' needs merge="),
        ({"merge": "tree"}, "merge='tree' is not one of"),
        ({"merge_rows": 4}, "merge_rows and pdl need merge="),
        ({"merge": "masked", "merge_rows": 3}, "merge_rows must be a power of two"),
        ({"speculative_tiles": 2, "merge": "masked"}, "speculative_tiles=2 needs"),
        ({"partial_dtype": torch.float16}, "partial_dtype must be"),
    ],
)
def test_variant_errors_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PagedAttentionVariant(**options)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))
def test_sweep_variant_in_cuda_graph(name: str) -> None:
    """LLaDA2.1-mini shapes in one captured graph; only the device prefix length changes."""
    case = make_case(num_queries=32, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                     prefix=5000, k_scale=0.03, v_scale=0.02, seed=2)
    args = (*case.values(), 128**-0.5, 0, 0, 0, SWEEP_VARIANTS[name])
    launch_paged_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_paged_attention(*args)
    for prefix in (0, 1, 17, 1000, 1024, 4096, 5000):
        case["prefix_len"].fill_(prefix)
        graph.replay()
        ref = paged_attention_reference(**case, softmax_scale=128**-0.5).float()
        bound = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, atol=0.02 * bound, rtol=0.02)


def test_default_variant_by_cache_type() -> None:
    """FP8 caches at head dim 128 on CUDA launch the interleaved splits (faster at 4k and 16k on
    the H200); head dims 256 and 512 on CUDA the contiguous splits with the speculative merge
    (faster at DiffusionGemma's canvas with either cache); BF16 caches at 128 and the CPU the
    contiguous splits with the chunked merge."""
    from dlmc.custom_ops._paged_attention_launch import DEFAULT_VARIANT, default_variant

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_variant(FP8, 128, cuda) == SWEEP_VARIANTS["ilv32"]
    assert default_variant(FP8, 128, cuda).split_order == "interleaved"
    for dtype, head_dim in ((FP8, 256), (BF16, 256), (FP8, 512), (BF16, 512)):
        variant = default_variant(dtype, head_dim, cuda)
        assert variant == SWEEP_VARIANTS["merge-spec"], (dtype, head_dim)
        assert (variant.split_order, variant.merge) == ("contiguous", "speculative")
    for dtype, head_dim, device in ((BF16, 128, cuda), (FP8, 128, cpu), (FP8, 256, cpu),
                                    (BF16, 512, cpu)):
        assert default_variant(dtype, head_dim, device) == DEFAULT_VARIANT
    assert (DEFAULT_VARIANT.split_order, DEFAULT_VARIANT.merge) == ("contiguous", "chunked")

