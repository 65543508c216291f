"""`dlmc::paged_attention` at DiffusionGemma's shapes against a dense attention over the masks
of the model's two passes (interpreter on CPU, GPU on GPU).

Sliding layers: head dim 256, 16 query heads over 8 KV heads, window W; full layers: head dim
512, 16 over 2, V = K (the same pool, tensors and scale). Softmax scale 1.0.
- Decoder (a bidirectional canvas): the canvas attends the last `W - 1` cached positions
  (sliding) or the whole cache (full), plus every canvas position; nothing is written.
- Encoder (a causal chunk): the query at position `p` attends keys `p - W + 1 .. p` (sliding)
  or `.. p` (full), cached and in the chunk (`window_per_query`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.kv_append import quantize_kv_reference
from dlmc.custom_ops.paged_attention import (
    SWEEP_VARIANTS,
    gather_prefix,
    paged_attention,
    paged_attention_reference,
)
from dlmc.errors import ConfigError

from .paged_attention_cases import DEVICE, FP8, assert_matches_reference, make_case

BF16 = torch.bfloat16
# (head dim, query heads, KV heads, V = K) of each layer kind
LAYERS = {"sliding": (256, 16, 8, False), "full": (512, 16, 2, True)}


def diffusiongemma_case(layer: str, queries: int, prefix: int, dtype: torch.dtype,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of a layer kind (q scaled to keep q·k at scale 1.0 moderate); full
    layers pass the K pool, tensor and scale as V too."""
    head_dim, q_heads, kv_heads, v_is_k = LAYERS[layer]
    case = make_case(num_queries=queries, num_q_heads=q_heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, page_size=16, prefix=prefix, k_scale=0.05, v_scale=0.03,
                     dtype=dtype, seed=seed)
    case["q"] = (case["q"].float() * head_dim**-0.5).bfloat16()
    if v_is_k:
        case["v_cache"], case["v_new"], case["v_scale"] = (case["k_cache"], case["k_new"],
                                                          case["k_scale"])
    return case


def doc_mask(queries: int, prefix: int, window: int | None, encoder: bool) -> torch.Tensor:
    """`[Tq, prefix + Tq]` visibility of keys (cached positions 0..C-1, then the block's, at
    C..C+Tq-1) for block query t at position C + t, written out from the model's masks."""
    p = prefix + torch.arange(queries)[:, None]  # [Tq, 1] query positions
    j = torch.arange(prefix + queries)[None, :]  # [1, S] key positions
    if encoder:  # causal, and (sliding) the last `window` keys up to the query itself
        visible = j <= p
        return visible & (j >= p - window + 1) if window else visible
    visible = torch.ones(queries, prefix + queries, dtype=torch.bool)  # bidirectional canvas
    if window:  # the last `window - 1` cached positions, the same for every canvas query
        visible[:, :prefix] = j[:, :prefix] >= prefix - (window - 1)
    return visible


def dense_attention(case: dict[str, torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ · 1.0, masked) · v in fp64 over the whole cache plus the block."""
    prefix = int(case["prefix_len"])
    keys, values = ([gather_prefix(case[f"{n}_cache"], case["page_table"], 0, prefix,
                                   case[f"{n}_scale"]).double(), case[f"{n}_new"].double()]
                    for n in ("k", "v"))
    keys, values = torch.cat(keys), torch.cat(values)  # [S, Hkv, D]
    group = case["q"].shape[1] // keys.shape[1]
    scores = torch.einsum("thd,shd->hts", case["q"].double(),
                          keys.repeat_interleave(group, dim=1))  # [Hq, Tq, S]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1),
                        values.repeat_interleave(group, dim=1))  # [Tq, Hq, D]


def assert_close_to_dense(out: torch.Tensor, dense: torch.Tensor, rel: float) -> None:
    bound = dense.abs().max().item()
    torch.testing.assert_close(out.double(), dense, atol=rel * bound, rtol=rel)


def options(window: int | None, encoder: bool) -> dict[str, object]:
    """The op's arguments for a pass: the decoder's anchored window, the encoder's causal
    chunk with a per-query window."""
    if encoder:
        return {"softmax_scale": 1.0, "window": window, "causal_block": 1,
                "window_per_query": window is not None}
    return {"softmax_scale": 1.0, "window": window}


# (layer, window, prefix, queries): windows shorter than the odd prefix (cutting a page), a
# window longer than the prefix, prefixes on and next to page boundaries.
CASES = [("sliding", 40, 77, 12), ("sliding", 17, 33, 7), ("sliding", 100, 45, 9),
         ("sliding", 2, 16, 5), ("full", None, 61, 9), ("full", None, 32, 5)]


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "encoder"])
@pytest.mark.parametrize(("layer", "window", "prefix", "queries"), CASES)
def test_matches_the_documented_masks(layer: str, window: int | None, prefix: int, queries: int,
                                      encoder: bool, dtype: torch.dtype) -> None:
    """The op (Triton) and its reference against the dense attention of the doc's mask; the
    decoder's op leaves the caches as they were (its canvas K/V are never written)."""
    case = diffusiongemma_case(layer, queries, prefix, dtype, seed=prefix)
    before = (case["k_cache"].clone(), case["v_cache"].clone())
    dense = dense_attention(case, doc_mask(queries, prefix, window, encoder))
    out = paged_attention(**case, **options(window, encoder))
    assert out.dtype == BF16 and torch.isfinite(out).all()
    assert_close_to_dense(out, dense, 0.02)
    assert_close_to_dense(paged_attention_reference(**case, **options(window, encoder)),
                          dense, 2**-7)  # (its output is bf16)
    assert torch.equal(case["k_cache"].view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(case["v_cache"].view(torch.uint8), before[1].view(torch.uint8))


@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "encoder"])
def test_window_edges_are_exact(encoder: bool) -> None:
    """Window W = 24, prefix C = 53: cached position C - W is visible to no query, so changing
    it changes nothing (bit for bit); C - W + 1 is the first visible to the decoder's whole
    canvas, and to the encoder's first query only."""
    window, prefix = 24, 53
    case = diffusiongemma_case("sliding", 6, prefix, BF16, seed=3)
    base = paged_attention(**case, **options(window, encoder))
    page = case["page_table"]
    for position, changed_rows in ((prefix - window, []),
                                   (prefix - window + 1, [0] if encoder else list(range(6)))):
        edited = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
        slot = (int(page[position // 16]), position % 16)
        edited["k_cache"][slot] = case["k_cache"][slot].float().neg().to(BF16)
        edited["v_cache"][slot] = 4.0
        out = paged_attention(**edited, **options(window, encoder))
        differs = (out != base).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert differs == changed_rows, (position, differs)


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_full_layer_append_with_v_equal_to_k(dtype: torch.dtype) -> None:
    """An encoder chunk on a full layer with V = K: `append=True` stores the chunk once in the
    one pool (as `kv_append` would: FP8-rounded with the one scale) and returns the pure op's
    output."""
    case = diffusiongemma_case("full", 7, 37, dtype, seed=5)
    pure = paged_attention(**case, **options(None, True))
    out = paged_attention(**case, **options(None, True), append=True)
    assert torch.equal(out, pure)
    stored = gather_prefix(case["k_cache"], case["page_table"], 37, 44, case["k_scale"])
    expected = quantize_kv_reference(case["k_new"], case["k_scale"], dtype).float()
    torch.testing.assert_close(stored, expected * case["k_scale"], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(SWEEP_VARIANTS))
def test_sweep_variants_with_a_per_query_window(name: str) -> None:
    """Every launch variant (interleaved splits with speculative tiles, flat merges, ...)
    with the encoder's per-query window, a window cutting tiles."""
    for prefix, window in ((70, 40), (130, 65), (5, 9)):
        case = make_case(num_queries=6, num_q_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, prefix=prefix, k_scale=0.05, v_scale=0.02, seed=prefix)
        assert_matches_reference(case, SWEEP_VARIANTS[name], softmax_scale=0.125, window=window,
                                 causal_block=1, window_per_query=True, num_splits=3)


@settings(max_examples=20 if DEVICE == "cpu" else 200, deadline=None)
@given(
    head_dim=st.sampled_from([64, 256, 512]), group=st.sampled_from([1, 2, 8]),
    num_queries=st.sampled_from([1, 3, 17]), page_size=st.sampled_from([1, 5, 16]),
    prefix=st.integers(0, 200), window=st.integers(1, 120),
    causal_block=st.sampled_from([None, 1, 4]), fp8=st.booleans(),
    num_splits=st.sampled_from([None, 1, 7]), seed=st.integers(0, 2**16),
)
def test_per_query_window_fuzz(head_dim: int, group: int, num_queries: int, page_size: int,
                               prefix: int, window: int, causal_block: int | None, fp8: bool,
                               num_splits: int | None, seed: int) -> None:
    case = make_case(num_queries=num_queries, num_q_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, page_size=page_size, prefix=prefix, k_scale=0.05,
                     v_scale=0.02, dtype=FP8 if fp8 else BF16, seed=seed)
    assert_matches_reference(case, softmax_scale=head_dim**-0.5, window=window,
                             causal_block=causal_block, window_per_query=True,
                             num_splits=num_splits)


def test_per_query_window_needs_a_window() -> None:
    case = make_case(num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=4,
                     prefix=3)
    for fn in (paged_attention, paged_attention_reference):
        with pytest.raises(ConfigError, match="window_per_query=True needs a window"):
            fn(**case, softmax_scale=1.0, causal_block=1, window_per_query=True)


@pytest.mark.parametrize("per_query", [False, True])
def test_opcheck_with_window_per_query(per_query: bool) -> None:
    from .test_paged_attention import opcheck_utils

    case = make_case(num_queries=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                     prefix=9, dtype=BF16)
    args = (*case.values(), 1.0, 5, 1, 2, per_query)
    torch.library.opcheck(torch.ops.dlmc.paged_attention.default, args,
                          test_utils=opcheck_utils(BF16))
