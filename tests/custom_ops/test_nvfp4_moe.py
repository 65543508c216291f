"""`dlmc::nvfp4_moe` against `nvfp4_moe_reference`: opcheck, hypothesis fuzzing, compile + graphs.

On CPU the Triton kernels run under `TRITON_INTERPRET=1` (set by tests/conftest.py), on tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter evaluates tl.sigmoid with numpy, which warns when exp(-g) overflows (result 0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def random_experts(
    gen: torch.Generator, num_experts: int, hidden: int, inter: int, *,
    scale_2_log2: tuple[float, float] = (-4.0, 1.0), max_scale_byte: int = 0x7E,
) -> dict[str, torch.Tensor]:
    """Random packed experts: every E2M1 code (incl. -0), FP8 scales from 2^-9 up to 448."""
    tensors: dict[str, torch.Tensor] = {}
    for proj, (out_f, in_f) in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                ("down", (hidden, inter))):
        tensors[f"{proj}_weight"] = torch.randint(
            0, 256, (num_experts, out_f, in_f // 2), generator=gen, dtype=torch.uint8)
        scale_bytes = torch.randint(0, max_scale_byte + 1, (num_experts, out_f, in_f // 16),
                                    generator=gen, dtype=torch.uint8)  # positive, no NaN
        tensors[f"{proj}_weight_scale"] = scale_bytes.view(torch.float8_e4m3fn)
        low, high = scale_2_log2
        exponent = torch.rand(num_experts, generator=gen) * (high - low) + low
        tensors[f"{proj}_weight_scale_2"] = (2.0 ** exponent) * (
            1 + torch.rand(num_experts, generator=gen))
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def random_routing(gen: torch.Generator, tokens: int, num_experts: int, top_k: int,
                   skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `skew` sends every token to the first `top_k` experts."""
    if skew:
        ids = torch.arange(top_k).repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                           for _ in range(tokens)]) if tokens else torch.zeros(0, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids.long().to(DEVICE), weights.float().to(DEVICE)


def op_args(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[str, torch.Tensor]
            ) -> tuple[torch.Tensor, ...]:
    names = [f"{p}_{s}" for p in ("gate", "up", "down")
             for s in ("weight", "weight_scale", "weight_scale_2")]
    return (x, ids, w, *(experts[n] for n in names))


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 summation order (which can flip a bf16 rounding of h or y)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(ref.float()).all()
    scale = ref.float().abs().amax().clamp_min(1e-30)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * float(scale))


def shared_expert(gen: torch.Generator, x: torch.Tensor, routed: torch.Tensor, hidden: int,
                  inter: int) -> dict[str, torch.Tensor]:
    """Random BF16 shared-expert weights (`shared_*` kwargs), the down projection scaled by a
    power of two (exact) so that the shared output is as large as the routed output `routed`."""
    weights = {"shared_gate": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,
               "shared_up": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,
               "shared_down": torch.randn(hidden, inter, generator=gen) * inter**-0.5}
    weights = {name: w.bfloat16().to(DEVICE) for name, w in weights.items()}
    g = torch.nn.functional.linear(x, weights["shared_gate"])
    y = torch.nn.functional.linear(torch.nn.functional.silu(g) * torch.nn.functional.linear(
        x, weights["shared_up"]), weights["shared_down"]).float()
    ratio = routed.float().abs().amax().clamp_min(1e-30) / y.abs().amax().clamp_min(1e-30)
    weights["shared_down"] *= 2.0 ** float(torch.log2(ratio).round().clamp(-100, 100))
    return weights


def run_case(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
             skew: bool, scale_2_log2: tuple[float, float] = (-4.0, 1.0),
             x_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter, scale_2_log2=scale_2_log2)
    x = (torch.randn(tokens, hidden, generator=gen) * x_scale).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    args = op_args(x, ids, w, experts)
    assert_matches_reference(nvfp4_moe(*args), nvfp4_moe_reference(*args))


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


def run_shared_case(seed: int, tokens: int, num_experts: int, used: int, top_k: int,
                    hidden: int, inter: int, emulate_w4a4: bool = False,
                    alone: bool = False) -> None:
    """The shared expert (the BF16 parts of `moe_shared_parts`) against the reference; tokens
    routed only to the first `used` experts (the others get none)."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, used, top_k, skew=False)
    args = op_args(x, ids, w, experts)
    scales = {}
    if emulate_w4a4:
        scales = {f"{p}_input_scale": (torch.rand(num_experts, generator=gen) * 0.01 + 1e-3)
                  .to(DEVICE) for p in ("gate", "up", "down")}
    routed = nvfp4_moe_reference(*args, emulate_w4a4=emulate_w4a4, **scales)
    shared = shared_expert(gen, x, routed, hidden, inter)
    ref = nvfp4_moe_reference(*args, emulate_w4a4=emulate_w4a4, **scales, **shared)
    assert_matches_reference(nvfp4_moe(*args, emulate_w4a4=emulate_w4a4, **scales, **shared), ref)
    # the shared expert counts (as much as the routed ones); `alone`: routed weights 0
    assert (ref.float() - routed.float()).abs().amax() > 0.1 * routed.float().abs().amax()
    if alone:
        zero = torch.zeros_like(w)
        assert_matches_reference(nvfp4_moe(x, ids, zero, *args[3:], **shared),
                                 nvfp4_moe_reference(x, ids, zero, *args[3:], **shared))


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


@pytest.mark.parametrize(("shared", "pairs"), [(False, False), (True, False), (True, True)])
def test_opcheck(shared: bool, pairs: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    experts = random_experts(gen, 3, 32, 16)
    x = torch.randn(4, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 4, 3, 2, skew=False)
    args = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for t in op_args(x, ids, w, experts)]  # the op takes the scales' bit patterns
    if shared:  # (gate_up_input_scale, down_input_scale, shared_gate, shared_up, shared_down)
        args += [None, None, *shared_expert(gen, x, x, 32, 16).values()]
    if pairs:  # (block_m, sorted_pair, expert_of_block: aligned in the op), pairs
        args += [0, None, None, True]
    torch.library.opcheck(torch.ops.dlmc.nvfp4_moe.default, args)


@pytest.mark.parametrize("shared", [False, True])
def test_pair_rows_combine_to_the_output(shared: bool) -> None:
    """`pairs=True` returns the rows the op combines: `moe_combine` of them is the op's output
    bit for bit, and `combine_pointwise` (`DLMC_MOE_COMBINE=outside`) within one bf16 rounding
    of their fp32 sum."""
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


V2_V3_FUZZ = given(
    seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
    top_k=st.integers(1, 8), hidden=st.sampled_from([16, 48, 128, 272, 2048]),
    inter=st.sampled_from([16, 80, 512]), skew=st.booleans(),
    scale_2_log2=st.sampled_from([(-4.0, 1.0), (-24.0, -20.0), (6.0, 8.0)]),
)


def run_variant(variant: int, *case: object) -> None:
    """`run_case` with kernel variant `variant` (DLMC_NVFP4_KERNEL, read at import) patched in."""
    import dlmc.custom_ops.nvfp4_moe as module

    previous, module._VARIANT = module._VARIANT, variant
    try:
        run_case(*case)
    finally:
        module._VARIANT = previous


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [2, 3])
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@V2_V3_FUZZ
def test_kernel_matches_reference_gpu(variant: int, seed: int, tokens: int, num_experts: int,
                                      top_k: int, hidden: int, inter: int, skew: bool,
                                      scale_2_log2: tuple[float, float]) -> None:
    """v2, and v3's bf16x2 inline-asm decode (DLMC_NVFP4_KERNEL=v3): every code, scales
    2^-9..448."""
    run_variant(variant, seed, tokens, num_experts, min(top_k, num_experts), hidden, inter, skew,
                scale_2_log2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 4, 5, 6, 7])
def test_v3_single_code_weights_are_exact_gpu(variant: int) -> None:
    """v3 (and v4-v7, their scales / weights converted per call here) and the reference agree
    bit for bit on power-of-two data (incl. subnormal scales)."""
    for scale_byte in (0x01, 0x38, 0x7E):
        experts = random_experts(torch.Generator().manual_seed(2), 2, 32, 16)
        for proj in ("gate", "up", "down"):
            weight = experts[f"{proj}_weight"]
            weight.zero_()
            # gate/up: codes 1 (0.5) then 9 (-0.5), E=0 (a bf16 subnormal in v3); down: code 1
            # only (with +-0.5 every h row is g*silu(g) twice and the output cancels to 0)
            weight[..., 0] = 0x01 if proj == "down" else 0x91
            experts[f"{proj}_weight_scale"].view(torch.uint8).fill_(scale_byte)
            experts[f"{proj}_weight_scale_2"].fill_(0.25)
        x = torch.randn(4, 32).bfloat16().to(DEVICE)
        ids = torch.tensor([[0], [1], [1], [0]], device=DEVICE)
        w = torch.full((4, 1), 0.5, device=DEVICE)
        args = op_args(x, ids, w, experts)
        import dlmc.custom_ops.nvfp4_moe as module

        previous, module._VARIANT = module._VARIANT, variant
        try:
            out = nvfp4_moe(*args)
        finally:
            module._VARIANT = previous
        ref = nvfp4_moe_reference(*args)
        assert ref.abs().amax() > 0
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("variant", [3, 4, 5, 6, 7])
def test_compile_and_cuda_graph_replay(variant: int, shared: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """v3, and v4-v7 with the block scales / weights as `NVFP4Experts` stores them; compiled
    (fullgraph), replayed as a CUDA graph with new routing and x copied in. `shared`: with the
    shared expert's BF16 parts."""
    import dlmc.custom_ops.nvfp4_moe as module
    from dlmc.custom_ops.nvfp4_words import stored_forms

    monkeypatch.setattr(module, "_VARIANT", variant)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    experts = random_experts(gen, 16, 256, 128)  # a shape the tiled layout (v5-v7) takes
    for proj in ("gate", "up", "down"):
        w, s = f"{proj}_weight", f"{proj}_weight_scale"
        experts[w], experts[s] = stored_forms(experts[w], experts[s], variant)
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
@pytest.mark.parametrize("variant", [2, 3, 4, 7])
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 300), num_experts=st.integers(1, 64),
       used=st.integers(1, 64), top_k=st.integers(1, 8),
       hidden=st.sampled_from([16, 48, 128, 272, 2048]), inter=st.sampled_from([16, 80, 512]))
def test_shared_expert_tail_matches_reference_gpu(variant: int, seed: int, tokens: int,
                                                  num_experts: int, used: int, top_k: int,
                                                  hidden: int, inter: int) -> None:
    """The compiled kernels' BF16 parts (next to v2's, v3's, v4's and v7's FP4 paths; v7 runs v3
    on shapes its layout cannot take), full size too."""
    import dlmc.custom_ops.nvfp4_moe as module

    used = min(used, num_experts)
    previous, module._VARIANT = module._VARIANT, variant
    try:
        run_shared_case(seed, tokens, num_experts, used, min(top_k, used), hidden, inter)
    finally:
        module._VARIANT = previous
    # progress for `pytest -s` runs with a time limit (perf/README.md records the count)
    print(f"v{variant} shared: tokens={tokens} experts={num_experts} used={used} top_k={top_k} "
          f"hidden={hidden} inter={inter}", flush=True)


@pytest.mark.parametrize("variant", [1, 2, 3])
@pytest.mark.parametrize(("tokens", "hidden", "inter"),
                         [(3, 48, 32), (17, 64, 48), (1, 16, 16), (3, 128, 160)])
def test_kernel_variants_match_reference(variant: int, tokens: int, hidden: int,
                                         inter: int) -> None:
    """Each DLMC_NVFP4_KERNEL variant (read at import; patched here). Interpreted, v3 runs its
    own loop and epilogue with the v2 decode (no inline asm on the CPU)."""
    for seed in range(3):
        run_variant(variant, seed, tokens, 5, 2, hidden, inter, seed == 1)


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
