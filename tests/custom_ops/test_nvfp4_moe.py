"""`dlmc::nvfp4_moe` against `nvfp4_moe_reference`: opcheck, hypothesis fuzzing, compile + graphs.

On CPU the Triton kernels run under `TRITON_INTERPRET=1` (set by tests/conftest.py), on tiny shapes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    assert_matches_reference,
    kernel_v3,
    op_args,
    random_experts,
    random_routing,
    run_case,
    run_shared_case,
    shared_expert,
    stored,
)

# The interpreter evaluates tl.sigmoid with numpy, which warns when exp(-g) overflows (result 0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 17, 64, 127, 300]),
    num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
    hidden=st.sampled_from([16, 32, 48, 64]), inter=st.sampled_from([16, 32, 48]),
    skew=st.booleans(), int32_ids=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)
def test_matches_reference_cpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                               inter: int, skew: bool, int32_ids: bool,
                               scale_2_log2: tuple[float, float]) -> None:
    top_k = min(top_k, num_experts)
    run_case(seed, tokens, num_experts, top_k, hidden, inter, skew, scale_2_log2)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 40), num_experts=st.integers(1, 6),
       used=st.integers(1, 6), top_k=st.integers(1, 3), hidden=st.sampled_from([16, 48, 64]),
       inter=st.sampled_from([16, 32, 48]))
def test_shared_expert_tail_matches_reference_cpu(seed: int, tokens: int, num_experts: int,
                                                  used: int, top_k: int, hidden: int,
                                                  inter: int) -> None:
    used = min(used, num_experts)
    run_shared_case(seed, tokens, num_experts, used, min(top_k, used), hidden, inter)


def test_shared_expert_tail_alone_and_with_w4a4_emulation() -> None:
    """Experts 3..7 get no token; with routed weights 0 the output is the shared expert's alone.
    With W4A4 emulation the routed activations are fake-quantized, the BF16 shared expert reads
    x as is."""
    run_shared_case(8, 17, 8, 3, 2, 48, 32, alone=True)
    run_shared_case(9, 7, 4, 3, 2, 32, 32, emulate_w4a4=True)


def test_zero_token_experts_and_int32_ids() -> None:
    gen = torch.Generator().manual_seed(1)
    experts = random_experts(gen, 8, 32, 32)
    empty = op_args(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE),
                    torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                    torch.zeros(0, 2, device=DEVICE), experts)
    assert nvfp4_moe(*empty).shape == (0, 32)
    x = torch.randn(3, 32, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[5, 2], [2, 5], [5, 7]], dtype=torch.int32, device=DEVICE)
    w = torch.rand(3, 2, generator=gen).to(DEVICE)
    args = op_args(x, ids, w, experts)
    assert_matches_reference(nvfp4_moe(*args), nvfp4_moe_reference(*args))


def test_single_code_weights_are_exact() -> None:
    """One nonzero code per row, power-of-two scales: kernel and reference agree bit for bit."""
    experts = random_experts(torch.Generator().manual_seed(2), 2, 32, 16)
    for proj in ("gate", "up", "down"):
        weight = experts[f"{proj}_weight"]
        weight.zero_()
        weight[..., 0] = 0x2A  # codes 10 (-1.0) then 2 (1.0)
        experts[f"{proj}_weight_scale"].fill_(0.5)
        experts[f"{proj}_weight_scale_2"].fill_(0.25)
    x = torch.randn(4, 32).bfloat16().to(DEVICE)
    ids = torch.tensor([[0], [1], [1], [0]], device=DEVICE)
    w = torch.full((4, 1), 0.5, device=DEVICE)
    args = op_args(x, ids, w, experts)
    torch.testing.assert_close(nvfp4_moe(*args), nvfp4_moe_reference(*args), rtol=0, atol=0)


def test_w4a4_emulation_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    experts = random_experts(gen, 4, 32, 32)
    x = torch.randn(5, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 5, 4, 2, skew=False)
    scales = {f"{p}_input_scale": (torch.rand(4, generator=gen) * 0.01 + 1e-3).to(DEVICE)
              for p in ("gate", "up", "down")}
    args = op_args(x, ids, w, experts)
    out = nvfp4_moe(*args, emulate_w4a4=True, **scales)
    ref = nvfp4_moe_reference(*args, emulate_w4a4=True, **scales)
    assert_matches_reference(out, ref)
    assert not torch.equal(ref, nvfp4_moe_reference(*args))


@pytest.mark.parametrize(("shared", "pairs", "pdl"),
                         [(False, False, True), (True, False, True), (True, True, True),
                          (True, True, False)])
def test_opcheck(shared: bool, pairs: bool, pdl: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    experts = random_experts(gen, 3, 32, 16)
    x = torch.randn(4, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    args = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for t in op_args(x, ids, w, experts)]  # the op takes the scales' bit patterns
    if shared:  # (gate_up_input_scale, down_input_scale, shared_gate, shared_up, shared_down)
        args += [None, None, *shared_expert(gen, x, x, 32, 16).values()]
    if pairs:  # pairs, pdl
        args += [True, pdl]
    torch.library.opcheck(torch.ops.dlmc.nvfp4_moe.default, args)


@pytest.mark.parametrize("shared", [False, True])
def test_pair_rows_combine_to_the_output(shared: bool) -> None:
    """`pairs=True` returns the rows the op combines: `moe_combine` of them is the op's output
    bit for bit, and `combine_pointwise` (the pointwise sum of a compiled round) within one
    bf16 rounding of their fp32 sum."""
    from dlmc.custom_ops.moe_combine import combine_pointwise, moe_combine
    from tests.custom_ops.test_moe_combine import assert_combined

    gen = torch.Generator().manual_seed(12)
    experts = random_experts(gen, 6, 32, 16)
    x = torch.randn(7, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 7, 6, 3, skew=True)
    extra = shared_expert(gen, x, x, 32, 16) if shared else {}
    args = op_args(x, ids, w, experts)
    rows = nvfp4_moe(*args, **extra, pairs=True)
    assert rows.shape == (7 * (3 + int(shared)), 32) and rows.dtype == torch.bfloat16
    out = nvfp4_moe(*args, **extra)
    weights = args[2]
    assert torch.equal(moe_combine(rows, weights, shared).view(torch.int16),
                       out.view(torch.int16))
    assert_combined(combine_pointwise(rows, weights, shared), rows, weights, shared)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
    top_k=st.integers(1, 8), hidden=st.sampled_from([16, 48, 128, 272, 512]),
    inter=st.sampled_from([16, 80, 128, 256]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)
def test_matches_reference_gpu(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                               inter: int, skew: bool, scale_2_log2: tuple[float, float]) -> None:
    top_k = min(top_k, num_experts)
    run_case(seed, tokens, num_experts, top_k, hidden, inter, skew, scale_2_log2)


@pytest.mark.gpu
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
    top_k=st.integers(1, 8), hidden=st.sampled_from([16, 48, 128, 272, 2048]),
    inter=st.sampled_from([16, 80, 512]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)
def test_v3_matches_reference_gpu(seed: int, tokens: int, num_experts: int, top_k: int,
                                  hidden: int, inter: int, skew: bool,
                                  scale_2_log2: tuple[float, float]) -> None:
    """v3's bf16x2 inline-asm decode on every shape: every code, scales 2^-9..448."""
    with kernel_v3():
        run_case(seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
                 scale_2_log2)


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "inter"), [(32, 16), (128, 128)], ids=["v3", "v7"])
def test_single_code_weights_are_exact_gpu(hidden: int, inter: int) -> None:
    """v3 and v7 (its stored forms) and the reference agree bit for bit on power-of-two data
    (incl. subnormal scales)."""
    for scale_byte in (0x01, 0x38, 0x7E):
        experts = random_experts(torch.Generator().manual_seed(2), 2, hidden, inter)
        for proj in ("gate", "up", "down"):
            weight = experts[f"{proj}_weight"]
            weight.zero_()
            # gate/up: codes 1 (0.5) then 9 (-0.5), E=0 (a bf16 subnormal in v3); down: code 1
            # only (with +-0.5 every h row is g*silu(g) twice and the output cancels to 0)
            weight[..., 0] = 0x01 if proj == "down" else 0x91
            experts[f"{proj}_weight_scale"].view(torch.uint8).fill_(scale_byte)
            experts[f"{proj}_weight_scale_2"].fill_(0.25)
        x = torch.randn(4, hidden).bfloat16().to(DEVICE)
        ids = torch.tensor([[0], [1], [1], [0]], device=DEVICE)
        w = torch.full((4, 1), 0.5, device=DEVICE)
        args = op_args(x, ids, w, experts)
        ref = nvfp4_moe_reference(*args)
        assert ref.abs().amax() > 0
        torch.testing.assert_close(nvfp4_moe(*op_args(x, ids, w, stored(experts))), ref,
                                   rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("variant", [3, 7])
def test_compile_and_cuda_graph_replay(variant: int, shared: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """v3, and v7 with the block scales / weights as `NVFP4Experts` stores them; compiled
    (fullgraph), replayed as a CUDA graph with new routing and x copied in. `shared`: with the
    shared expert."""
    if variant == 3:
        monkeypatch.setattr(launch, "effective_variant", lambda hidden, inter: 3)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    experts = random_experts(gen, 16, 256, 128)  # a shape the tiled layout (v7) takes
    if variant == 7:
        experts = stored(experts)
    x = torch.randn(32, 256, generator=gen).bfloat16().cuda()
    ids, w = random_routing(gen, 32, 16, 4, skew=False)
    args = op_args(x, ids, w, experts)
    kwargs = shared_expert(gen, x, nvfp4_moe_reference(*args), 256, 128) if shared else {}
    compiled = torch.compile(nvfp4_moe, fullgraph=True)
    expected = nvfp4_moe_reference(*args, **kwargs)
    assert_matches_reference(compiled(*args, **kwargs), expected)
    static_out = compiled(*args, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = compiled(*args, **kwargs)
    new_ids, new_w = random_routing(gen, 32, 16, 4, skew=True)
    x.copy_(torch.randn(32, 256, generator=gen).bfloat16())
    args[1].copy_(new_ids)
    args[2].copy_(new_w)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(static_out, nvfp4_moe_reference(*args, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 7])
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
       used=st.integers(1, 64), top_k=st.integers(1, 8),
       hidden=st.sampled_from([16, 48, 128, 272, 2048]), inter=st.sampled_from([16, 80, 512]))
def test_shared_expert_tail_matches_reference_gpu(variant: int, seed: int, tokens: int,
                                                  num_experts: int, used: int, top_k: int,
                                                  hidden: int, inter: int) -> None:
    """The compiled kernels' shared expert next to v3's and v7's FP4 paths (v7 runs v3 on shapes
    its layout cannot take), full size too."""
    used = min(used, num_experts)
    with kernel_v3() if variant == 3 else contextlib.nullcontext():
        run_shared_case(seed, tokens, num_experts, used, min(top_k, used), hidden, inter)


@pytest.mark.parametrize(("tokens", "hidden", "inter"),
                         [(3, 48, 32), (17, 64, 48), (1, 16, 16), (3, 128, 160)])
def test_v3_shapes_match_reference(tokens: int, hidden: int, inter: int) -> None:
    """Shapes the tiled layout cannot take (kernel v3; interpreted, its plain Triton decode)."""
    for seed in range(3):
        run_case(seed, tokens, 5, 2, hidden, inter, seed == 1)


def test_compile_aot_eager_fullgraph() -> None:
    """The fake impl lets dynamo/AOT trace the op without graph breaks (any device)."""
    gen = torch.Generator().manual_seed(8)
    experts = random_experts(gen, 3, 32, 16)
    x = torch.randn(5, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 5, 3, 2, skew=False)
    args = op_args(x, ids, w, experts)
    torch._dynamo.reset()
    compiled = torch.compile(nvfp4_moe, backend="aot_eager", fullgraph=True)
    assert_matches_reference(compiled(*args), nvfp4_moe_reference(*args))
