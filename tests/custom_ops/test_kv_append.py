"""`dlmc::kv_append` is bit-exact with its reference (FP8 rounding and saturation included)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.kv_append import kv_append, kv_append_reference
from dlmc.errors import ConfigError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int16)


def run_both(
    k: torch.Tensor, v: torch.Tensor, *, page_size: int, num_pages: int, offset: int,
    k_scale: float, v_scale: float, dtype: torch.dtype, seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, k.shape[1], k.shape[2])
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)  # stale contents
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    args = {
        "page_table": torch.randperm(num_pages, generator=gen).to(torch.int32).to(DEVICE),
        "offset": torch.tensor([offset], dtype=torch.int32, device=DEVICE),
        "k_scale": torch.tensor([k_scale], device=DEVICE),
        "v_scale": torch.tensor([v_scale], device=DEVICE),
    }
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_append(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, **args)
    kv_append_reference(k.to(DEVICE), v.to(DEVICE), k_ref, v_ref, **args)
    assert torch.equal(as_bits(k_cache), as_bits(k_ref))
    assert torch.equal(as_bits(v_cache), as_bits(v_ref))


def test_fp8_rounding_ties_and_saturation() -> None:
    """Every E4M3 value, every midpoint between neighbours (ties), values past ±448, subnormals."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    midpoints = (codes[1:] + codes[:-1]) / 2
    extra = torch.tensor([449.0, 464.0, 480.0, 1e6, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-12])
    values = torch.cat([codes, midpoints, extra, midpoints * 1.0001, midpoints * 0.9999])
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 32
    k = torch.cat([values, torch.zeros(pad)]).reshape(-1, 1, 32).bfloat16()  # bf16-rounded
    v = torch.cat([values, torch.zeros(pad)]).reshape(-1, 1, 32).float().bfloat16()
    run_both(k, v, page_size=4, num_pages=math.ceil(k.shape[0] / 4), offset=0, k_scale=1.0,
             v_scale=0.5, dtype=FP8)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 3, 4, 5, 30])
def test_page_boundaries_and_capacity(dtype: torch.dtype, offset: int) -> None:
    k = torch.randn(7, 2, 64).bfloat16() * 10
    v = torch.randn(7, 2, 64).bfloat16()
    run_both(k, v, page_size=4, num_pages=9, offset=offset, k_scale=0.05, v_scale=2.0,
             dtype=dtype)  # offset 30: tokens past the 36 slots are dropped


@settings(max_examples=20 if DEVICE == "cpu" else 200, deadline=None)
@given(
    num_tokens=st.sampled_from([1, 3, 17, 32, 127]), num_kv_heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([128, 256, 512]), page_size=st.sampled_from([1, 7, 16]),
    offset=st.integers(0, 400), log_scales=st.tuples(st.floats(-9, 9), st.floats(-9, 9)),
    fp8=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference(
    num_tokens: int, num_kv_heads: int, head_dim: int, page_size: int, offset: int,
    log_scales: tuple[float, float], fp8: bool, seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.empty(num_tokens, num_kv_heads, head_dim).uniform_(-9, 9,
                                                                                 generator=gen))
    k = (torch.randn(magnitude.shape, generator=gen) * magnitude).bfloat16()
    v = (torch.randn(magnitude.shape, generator=gen) * magnitude).bfloat16()
    num_pages = math.ceil((offset + num_tokens) / page_size)
    run_both(k, v, page_size=page_size, num_pages=num_pages, offset=offset,
             k_scale=math.exp(log_scales[0]), v_scale=math.exp(log_scales[1]),
             dtype=FP8 if fp8 else torch.bfloat16, seed=seed)


def test_opcheck() -> None:
    k = torch.randn(5, 2, 32).bfloat16().to(DEVICE)
    cache = torch.zeros(4, 4, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    args = (k, k.clone(), cache, cache.clone(),
            torch.arange(4, dtype=torch.int32, device=DEVICE),
            torch.tensor([3], dtype=torch.int32, device=DEVICE),
            torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE))
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if DEVICE == "cuda":  # the interpreter cannot be traced
        utils.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.dlmc.kv_append.default, args, test_utils=tuple(utils))


def test_errors_name_the_tensor() -> None:
    k = torch.randn(2, 1, 32).bfloat16()
    cache = torch.zeros(2, 4, 1, 32, dtype=FP8)
    table = torch.arange(2, dtype=torch.int32)
    one = torch.ones(1)
    with pytest.raises(ConfigError, match="offset must be"):
        kv_append(k, k, cache, cache.clone(), table, torch.tensor([0]), k_scale=one, v_scale=one)
    with pytest.raises(ConfigError, match="k_cache must be"):
        kv_append(k, k, cache.float(), cache.float(), table, torch.tensor([0], dtype=torch.int32),
                  k_scale=one, v_scale=one)


@pytest.mark.gpu
def test_cuda_graph_replay_appends_at_the_device_offset() -> None:
    k = torch.randn(32, 4, 128, device="cuda").bfloat16()
    v = torch.randn(32, 4, 128, device="cuda").bfloat16()
    k_cache = torch.zeros(64, 16, 4, 128, dtype=FP8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(64, device="cuda").to(torch.int32)
    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    scales = {"k_scale": torch.tensor([0.01], device="cuda"),
              "v_scale": torch.tensor([0.02], device="cuda")}
    append = torch.compile(kv_append, fullgraph=True)
    append(k, v, k_cache, v_cache, table, offset, **scales)  # warm-up (compile) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append(k, v, k_cache, v_cache, table, offset, **scales)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for start in (0, 32, 50, 1000):
        offset.fill_(start)
        k.normal_()
        graph.replay()
        kv_append_reference(k, v, k_ref, v_ref, table, offset, **scales)
    assert torch.equal(as_bits(k_cache), as_bits(k_ref))
    assert torch.equal(as_bits(v_cache), as_bits(v_ref))
