"""`dlmc::paged_attention_append` (attention + kv_append in one launch) against the two ops.

The appending launch must leave the caches bit-identical to `dlmc::kv_append` (FP8 rounding,
saturation, positions past capacity dropped) and return exactly the pure op's output, for every
launch variant (contiguous and interleaved split orders, several row blocks), on CPU through
Triton's interpreter and on the GPU compiled and replayed in a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.kv_append import kv_append, kv_append_reference
from dlmc.custom_ops.paged_attention import (
    SWEEP_VARIANTS,
    PagedAttentionVariant,
    launch_paged_attention,
    paged_attention,
    paged_attention_reference,
)

from .paged_attention_cases import DEVICE, FP8, make_case
from .test_paged_attention_variants import variants

BF16 = torch.bfloat16
# (prefix, spare pages, cache dtype) at page size 4 and 5 block tokens: an empty cache, a block
# that crosses a page boundary, and blocks whose last tokens pass the pool's capacity (dropped:
# 1 of 5 kept at prefix 19 in 20 slots, 2 of 5 at prefix 22 in 24 slots).
PREFIXES = ((0, 1, FP8), (6, 1, BF16), (19, 0, FP8), (22, 0, BF16))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int16)


def assert_fused_matches_separate(case: dict[str, torch.Tensor],
                                  variant: PagedAttentionVariant | None,
                                  **options: object) -> None:
    """Appending launch vs kv_append + the pure launch (same variant): equal cache bits and
    output, and every block token below capacity stored (its row differs from the stale one)."""
    fused = {name: t.clone() for name, t in case.items()}
    stale = as_bits(case["k_cache"]).clone()
    args = (float(options.get("softmax_scale", 0.25)), options.get("window") or 0,
            options.get("causal_block") or 0, options.get("num_splits") or 0, variant)
    out = launch_paged_attention(*fused.values(), *args, append=True)
    kv_append(case["k_new"], case["v_new"], case["k_cache"], case["v_cache"],
              case["page_table"], case["prefix_len"], k_scale=case["k_scale"],
              v_scale=case["v_scale"])
    expected = launch_paged_attention(*case.values(), *args)
    assert torch.equal(as_bits(fused["k_cache"]), as_bits(case["k_cache"]))
    assert torch.equal(as_bits(fused["v_cache"]), as_bits(case["v_cache"]))
    assert torch.equal(out, expected)
    num_pages, page_size = stale.shape[:2]
    prefix = int(case["prefix_len"][0])
    slots = torch.arange(prefix, min(prefix + case["q"].shape[0], num_pages * page_size),
                         device=stale.device)
    pages = case["page_table"][slots // page_size].long()
    changed = as_bits(fused["k_cache"])[pages, slots % page_size] != stale[pages, slots % page_size]
    assert changed.flatten(1).any(1).all()  # [stored tokens, Hkv * D]: each row rewritten


@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))  # "base" is also the CPU default
def test_sweep_variant_appends_as_kv_append(name: str) -> None:
    for prefix, spare_pages, dtype in PREFIXES:
        case = make_case(num_queries=5, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                         prefix=prefix, k_scale=0.004, v_scale=0.02, dtype=dtype,
                         spare_pages=spare_pages, seed=prefix)
        assert_fused_matches_separate(case, SWEEP_VARIANTS[name], num_splits=2)


def test_every_token_once_whatever_the_row_blocks() -> None:
    """3 row blocks of 16 rows (only block 0 stores), 3 store steps of 8 tokens at D=512,
    block-causal."""
    case = make_case(num_queries=17, num_q_heads=4, num_kv_heads=2, head_dim=512, page_size=4,
                     prefix=9, k_scale=1e-3, v_scale=3.0, seed=3)
    assert_fused_matches_separate(case, PagedAttentionVariant(tile=(16, 16, 4)),
                                  causal_block=4)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [FP8, BF16])
def test_op_appends_like_the_reference(backend: str, dtype: torch.dtype) -> None:
    """`paged_attention(append=True)` = `kv_append_reference`, then the attention."""
    case = make_case(num_queries=6, num_q_heads=4, num_kv_heads=1, head_dim=32, page_size=4,
                     prefix=21, k_scale=0.01, v_scale=0.5, dtype=dtype, spare_pages=0, seed=5)
    reference = {name: t.clone() for name, t in case.items()}
    out = paged_attention(**case, softmax_scale=0.2, backend=backend, append=True)
    kv_append_reference(reference["k_new"], reference["v_new"], reference["k_cache"],
                        reference["v_cache"], reference["page_table"], reference["prefix_len"],
                        k_scale=reference["k_scale"], v_scale=reference["v_scale"])
    assert torch.equal(as_bits(case["k_cache"]), as_bits(reference["k_cache"]))
    assert torch.equal(as_bits(case["v_cache"]), as_bits(reference["v_cache"]))
    ref = paged_attention_reference(**reference, softmax_scale=0.2).float()
    bound = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=0.02 * bound, rtol=0.02)


@settings(max_examples=6 if DEVICE == "cpu" else 50, deadline=None)
@given(
    variant=variants(), head_dim=st.sampled_from([16, 64, 512]), group=st.sampled_from([1, 4]),
    num_kv_heads=st.sampled_from([1, 2]), num_queries=st.sampled_from([1, 3, 17, 33]),
    page_size=st.sampled_from([1, 5, 16]), prefix=st.integers(0, 120),
    spare_pages=st.integers(0, 2), log_scales=st.tuples(st.floats(-7, 7), st.floats(-7, 7)),
    window=st.one_of(st.none(), st.integers(1, 100)), fp8=st.booleans(),
    causal_block=st.sampled_from([None, 1, 4]), num_splits=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_fused_against_separate(
    variant: PagedAttentionVariant, head_dim: int, group: int, num_kv_heads: int,
    num_queries: int, page_size: int, prefix: int, spare_pages: int,
    log_scales: tuple[float, float], window: int | None, fp8: bool, causal_block: int | None,
    num_splits: int, seed: int,
) -> None:
    case = make_case(num_queries=num_queries, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     prefix=prefix, k_scale=math.exp(log_scales[0]),
                     v_scale=math.exp(log_scales[1]), dtype=FP8 if fp8 else BF16,
                     spare_pages=spare_pages, seed=seed)
    assert_fused_matches_separate(case, variant, softmax_scale=head_dim**-0.5, window=window,
                                  causal_block=causal_block, num_splits=num_splits)


def test_opcheck() -> None:
    case = make_case(num_queries=3, num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=4,
                     prefix=5, dtype=BF16)  # opcheck compares with ops FP8 lacks on CPU
    args = (*case.values(), 0.25, 0, 0, 2)
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if DEVICE == "cuda":  # the interpreter cannot be traced
        utils.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.dlmc.paged_attention_append.default, args,
                          test_utils=tuple(utils))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_compiled_graph_replay_appends_at_the_device_prefix(dtype: torch.dtype) -> None:
    """LLaDA2.1-mini shapes, the op's default launch (FP8: interleaved; BF16: contiguous),
    compiled with fullgraph and captured once; replays at moving prefixes (the last one past
    the capacity) write exactly kv_append_reference's bytes and return the reference output."""
    from .graph_capture import compile_and_capture

    case = make_case(num_queries=32, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                     prefix=4000, k_scale=0.03, v_scale=0.02, dtype=dtype, seed=4)
    capacity = case["k_cache"].shape[0] * 16  # 4,032 slots

    def fused(q, k_new, v_new, k_cache, v_cache, page_table, prefix_len, k_scale, v_scale):
        return paged_attention(q, k_new, v_new, k_cache, v_cache, page_table, prefix_len,
                               k_scale=k_scale, v_scale=v_scale, softmax_scale=128**-0.5,
                               append=True)

    graph, out = compile_and_capture(fused, *case.values())
    expected = {name: t.clone() for name, t in case.items()}
    for prefix in (0, 17, 1024, 3000, capacity - 5):
        for name in ("q", "k_new", "v_new"):
            case[name].normal_()
            expected[name].copy_(case[name])
        case["prefix_len"].fill_(prefix)
        expected["prefix_len"].fill_(prefix)
        graph.replay()
        kv_append_reference(expected["k_new"], expected["v_new"], expected["k_cache"],
                            expected["v_cache"], expected["page_table"], expected["prefix_len"],
                            k_scale=expected["k_scale"], v_scale=expected["v_scale"])
        ref = paged_attention_reference(**expected, softmax_scale=128**-0.5).float()
        bound = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, atol=0.02 * bound, rtol=0.02)
        assert torch.equal(as_bits(case["k_cache"]), as_bits(expected["k_cache"]))
        assert torch.equal(as_bits(case["v_cache"]), as_bits(expected["v_cache"]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))
def test_sweep_variant_appends_in_cuda_graph(name: str) -> None:
    """Every variant's appending launch captured once (PDL included): the caches match
    kv_append and the output the pure launch's, at prefixes 0 .. past capacity."""
    case = make_case(num_queries=32, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                     prefix=5000, k_scale=0.03, v_scale=0.02, seed=2)
    capacity = case["k_cache"].shape[0] * 16
    args = (128**-0.5, 0, 0, 0, SWEEP_VARIANTS[name])
    launch_paged_attention(*case.values(), *args, append=True)  # compile outside the capture
    separate = {key: t.clone() for key, t in case.items()}  # after the warm-up's append
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_paged_attention(*case.values(), *args, append=True)
    for prefix in (0, 1, 1000, 4096, capacity - 7):
        case["k_new"].normal_()
        separate["k_new"].copy_(case["k_new"])
        case["prefix_len"].fill_(prefix)
        separate["prefix_len"].fill_(prefix)
        graph.replay()
        kv_append(separate["k_new"], separate["v_new"], separate["k_cache"],
                  separate["v_cache"], separate["page_table"], separate["prefix_len"],
                  k_scale=separate["k_scale"], v_scale=separate["v_scale"])
        expected = launch_paged_attention(*separate.values(), *args)
        assert torch.equal(out, expected)
        assert torch.equal(as_bits(case["k_cache"]), as_bits(separate["k_cache"]))
        assert torch.equal(as_bits(case["v_cache"]), as_bits(separate["v_cache"]))
