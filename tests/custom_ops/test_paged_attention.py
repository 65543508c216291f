"""`dlmc::paged_attention` against its plain-PyTorch reference (interpreter on CPU, GPU on GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.paged_attention import paged_attention, paged_attention_reference
from dlmc.errors import ConfigError

from .paged_attention_cases import DEVICE, FP8, assert_matches_reference, make_case


def opcheck_utils(cache_dtype: torch.dtype) -> tuple[str, ...]:
    """opcheck's tests that apply here.

    test_schema compares inputs with arithmetic FP8 tensors lack; test_aot_dispatch_dynamic
    traces the kernel launch, which Triton's CPU interpreter cannot do (it runs on GPU).
    """
    utils = ["test_autograd_registration", "test_faketensor"]
    if cache_dtype != torch.float8_e4m3fn:
        utils.append("test_schema")
    if torch.cuda.is_available():
        utils.append("test_aot_dispatch_dynamic")
    return tuple(utils)


def test_matches_reference_llada2_shape() -> None:
    case = make_case(num_queries=32, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                     prefix=70, k_scale=0.05, v_scale=0.02)
    assert_matches_reference(case, softmax_scale=128**-0.5)


def test_matches_reference_diffusiongemma_sliding_shape() -> None:
    """A 256-token canvas, 2 q heads per KV head, D=256, scale 1.0, window anchored at the start."""
    case = make_case(num_queries=256, num_q_heads=2, num_kv_heads=1, head_dim=256, page_size=16,
                     prefix=90, k_scale=0.05, v_scale=0.05)
    case["q"] = case["q"] / 16  # RMS-normed q·k at scale 1.0: keep the logits moderate
    assert_matches_reference(case, softmax_scale=1.0, window=40)


@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 31, 32, 33, 64])
def test_page_boundaries(prefix: int) -> None:
    case = make_case(num_queries=3, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                     prefix=prefix)
    assert_matches_reference(case, softmax_scale=0.125, num_splits=3)


@pytest.mark.parametrize("window", [1, 2, 17, 40, 1000])
def test_sliding_window_anchored_at_block_start(window: int) -> None:
    case = make_case(num_queries=5, num_q_heads=2, num_kv_heads=1, head_dim=256, page_size=8,
                     prefix=45, dtype=torch.bfloat16)
    assert_matches_reference(case, softmax_scale=1.0 / 16, window=window)


@pytest.mark.parametrize("causal_block", [1, 4])
def test_block_causal_new_tokens(causal_block: int) -> None:
    case = make_case(num_queries=9, num_q_heads=2, num_kv_heads=2, head_dim=32, page_size=4,
                     prefix=10)
    assert_matches_reference(case, softmax_scale=0.2, causal_block=causal_block)


def test_prefix_clamped_to_capacity() -> None:
    case = make_case(num_queries=2, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=4,
                     prefix=8, spare_pages=0)
    case["prefix_len"].fill_(1000)  # past the table's 8 slots: reads stop at capacity
    assert_matches_reference(case, softmax_scale=0.2)


@settings(max_examples=25 if DEVICE == "cpu" else 5, deadline=None)
@given(
    head_dim=st.sampled_from([128, 256, 512]), group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]), num_queries=st.sampled_from([1, 3, 17, 32]),
    page_size=st.sampled_from([1, 5, 16]), prefix=st.integers(0, 300),
    log_scales=st.tuples(st.floats(-7, 7), st.floats(-7, 7)),
    window=st.one_of(st.none(), st.integers(1, 400)), fp8=st.booleans(),
    num_splits=st.sampled_from([None, 1, 2, 7]), seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference(
    head_dim: int, group: int, num_kv_heads: int, num_queries: int, page_size: int, prefix: int,
    log_scales: tuple[float, float], window: int | None, fp8: bool, num_splits: int | None,
    seed: int,
) -> None:
    case = make_case(num_queries=num_queries, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     prefix=prefix, k_scale=math.exp(log_scales[0]),
                     v_scale=math.exp(log_scales[1]), dtype=FP8 if fp8 else torch.bfloat16,
                     seed=seed)
    assert_matches_reference(case, softmax_scale=head_dim**-0.5, window=window,
                             num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_opcheck(dtype: torch.dtype) -> None:
    case = make_case(num_queries=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                     prefix=9, dtype=dtype)
    args = tuple(case.values()) + (0.3, 0, 0, 2)
    torch.library.opcheck(torch.ops.dlmc.paged_attention.default, args,
                          test_utils=opcheck_utils(dtype))


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("q", lambda t: t.float(), "q must be"),
        ("k_cache", lambda t: t.float(), "k_cache must be"),
        ("page_table", lambda t: t.long(), "page_table must be"),
        ("prefix_len", lambda t: t.long(), "prefix_len must be"),
        ("k_scale", lambda t: t.double(), "k_scale must be"),
        ("k_new", lambda t: t[:, :1], "k_new must be"),
    ],
)
def test_errors_name_the_tensor(name: str, bad: object, message: str) -> None:
    case = make_case(num_queries=2, num_q_heads=2, num_kv_heads=2, head_dim=32, page_size=4,
                     prefix=3)
    case[name] = bad(case[name])  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message):
        paged_attention(**case, softmax_scale=1.0)


def test_unknown_backend_names_the_option() -> None:
    case = make_case(num_queries=2, num_q_heads=2, num_kv_heads=2, head_dim=32, page_size=4,
                     prefix=3)
    with pytest.raises(ConfigError, match="backend="):
        paged_attention(**case, softmax_scale=1.0, backend="cuda")


@pytest.mark.gpu
@settings(max_examples=200, deadline=None)
@given(
    head_dim=st.sampled_from([128, 256, 512]), group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2, 4]), num_queries=st.sampled_from([1, 17, 32, 256]),
    page_size=st.sampled_from([16, 64]), prefix=st.integers(0, 6000),
    log_scales=st.tuples(st.floats(-7, 7), st.floats(-7, 7)),
    window=st.one_of(st.none(), st.integers(1, 2048)), fp8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference_gpu(
    head_dim: int, group: int, num_kv_heads: int, num_queries: int, page_size: int, prefix: int,
    log_scales: tuple[float, float], window: int | None, fp8: bool, seed: int,
) -> None:
    # Page size 1 and the default split count run in the CPU tests; fixing them here keeps
    # the number of compiled kernel variants (and the GPU time) small.
    case = make_case(num_queries=num_queries, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     prefix=prefix, k_scale=math.exp(log_scales[0]),
                     v_scale=math.exp(log_scales[1]), dtype=FP8 if fp8 else torch.bfloat16,
                     seed=seed)
    assert_matches_reference(case, softmax_scale=head_dim**-0.5, window=window, num_splits=32)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 700])
def test_compile_and_cuda_graph_replay(window: int | None) -> None:
    """One captured graph serves every prefix length: only the device tensor changes."""
    case = make_case(num_queries=32, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                     prefix=3000, k_scale=0.03, v_scale=0.02, seed=1)
    options = {"softmax_scale": 128**-0.5, "window": window}
    inputs = {name: case.pop(name) for name in ("q", "k_new", "v_new")}

    @torch.compile(fullgraph=True)
    def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k_new, v_new, **case, **options)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            block_attention(**inputs)  # compile + autotune outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_attention(**inputs)
    for prefix in (0, 1, 17, 1024, 2999, 3000):
        case["prefix_len"].fill_(prefix)
        for t in inputs.values():
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        ref = paged_attention_reference(**inputs, **case, **options)
        bound = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), atol=0.02 * bound, rtol=0.02)
