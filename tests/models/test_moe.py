import pytest
import torch

from dlmc.custom_ops.moe_align import append_shared_column
from dlmc.custom_ops.router_gemm import router_gemm as moe_router_gemm
from dlmc.loading.tiny import TINY_CONFIG
from dlmc.models.config import LLaDA2Config
from dlmc.models.moe import EXPERT_PROJECTIONS, BF16Experts, Router


def _router(**overrides):
    cfg = LLaDA2Config.from_dict({**TINY_CONFIG, **overrides})
    router = Router(cfg)
    router.weight.data = torch.eye(cfg.num_experts, cfg.hidden_size)
    return cfg, router


def _random_router():
    """(config, a Router with random weights and bias, the test device)."""
    cfg, router = _router()
    router.weight.data = torch.randn(cfg.num_experts, cfg.hidden_size) * 0.3
    router.expert_bias.normal_(0.0, 0.1)
    return cfg, router, "cuda" if torch.cuda.is_available() else "cpu"


def test_router_group_limit_and_bias_only_for_selection():
    # 16 experts in 4 groups of 4, keep 2 groups, top 4.
    cfg, router = _router()
    logits = torch.full((16,), -4.0)
    logits[[0, 1]] = 3.0  # group 0: strong pair
    logits[[4, 5]] = 2.0  # group 1
    logits[[8]] = 4.0  # group 2: one very strong expert, weak second
    bias = torch.zeros(16)
    bias[12] = bias[13] = 10.0  # group 3 wins through the bias alone
    router.expert_bias.copy_(bias)
    x = torch.zeros(1, cfg.hidden_size)
    x[0, :16] = logits
    ids, weights = router(x)
    chosen = set(ids[0].tolist())
    assert chosen <= {0, 1, 2, 3, 12, 13, 14, 15}  # groups 0 and 3 only
    assert {12, 13, 0, 1} == chosen
    s = torch.sigmoid(logits[ids[0]])  # unbiased scores
    expected = s / s.sum() * cfg.routed_scaling_factor
    torch.testing.assert_close(weights[0], expected)


def test_router_without_renormalisation():
    cfg, router = _router(norm_topk_prob=False)
    x = torch.randn(3, cfg.hidden_size)
    ids, weights = router(x)
    s = torch.sigmoid(x.float() @ router.weight.t()).gather(1, ids)
    torch.testing.assert_close(weights, s * cfg.routed_scaling_factor)


def test_router_through_the_triton_op(monkeypatch):
    """Router with `dlmc::moe_route` (CUDA, or Triton's interpreter on CPU) and with the torch
    maths (what it runs on CPU): the same routing."""
    import dlmc.models.moe as moe

    cfg, router, device = _random_router()
    router, x = router.to(device), torch.randn(9, cfg.hidden_size).to(device)
    routed = {}
    for route in (moe.moe_route_reference, moe.moe_route):
        monkeypatch.setattr(moe, "moe_route", route)
        monkeypatch.setattr(moe, "moe_route_reference", route)
        routed[route] = router(x)
    (want_ids, want_weights), (ids, weights) = routed.values()
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_router_split_gemm_routes_like_cublas(monkeypatch):
    """`dlmc::router_gemm` partials (CUDA, or Triton's interpreter on CPU) summed by the
    routing: the same picks as `F.linear` logits (no near-ties here)."""
    import dlmc.models.moe as moe

    cfg, router, device = _random_router()
    router, x = router.to(device), torch.randn(9, cfg.hidden_size).bfloat16().to(device)
    monkeypatch.setattr(router, "_split_gemm", lambda x: False)
    want_ids, want_weights = router(x)
    monkeypatch.setattr(router, "_split_gemm", lambda x: True)  # as for a CUDA block
    calls = []
    monkeypatch.setattr(moe, "router_gemm", lambda *a: calls.append(a) or moe_router_gemm(*a))
    ids, weights = router(x)
    assert calls, "the split GEMM did not run"
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=0)


def test_router_split_gemm_takes_small_bf16_cuda_blocks_only():
    """The split GEMM runs for bf16 blocks of at most 64 tokens on CUDA; CPU runs (also under
    Triton's interpreter), fp32 inputs and longer inputs keep F.linear."""
    cfg, router = _router()
    assert not router._split_gemm(torch.randn(9, cfg.hidden_size).bfloat16())  # CPU tensor
    if torch.cuda.is_available():
        assert router._split_gemm(torch.randn(9, cfg.hidden_size, device="cuda").bfloat16())
        assert not router._split_gemm(torch.randn(9, cfg.hidden_size, device="cuda"))
        assert not router._split_gemm(torch.randn(65, cfg.hidden_size,
                                                  device="cuda").bfloat16())


def test_random_model_keeps_the_router_weight_fp32():
    from dlmc.models.shapes import build_random_model

    cfg = LLaDA2Config.from_dict(TINY_CONFIG)
    model = build_random_model(cfg, torch.device("cpu"), torch.bfloat16)
    gate = model.model.layers[cfg.first_k_dense_replace].mlp.gate
    assert gate.weight.dtype == gate.expert_bias.dtype == torch.float32
    assert 0.5 < gate.weight.std().item() * cfg.hidden_size**0.5 < 2.0  # like the parameters


def test_bf16_experts_match_per_token_loop():
    torch.manual_seed(0)
    experts = BF16Experts(6, 8, 5)
    for p in experts.parameters():
        p.data.normal_()
    x = torch.randn(7, 8)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(7)])
    w = torch.rand(7, 3)
    out = experts(x, ids, w)
    for t in range(7):
        want = torch.zeros(8)
        for k in range(3):
            e = ids[t, k]
            h = torch.nn.functional.silu(experts.gate_proj_weight[e] @ x[t])
            h = h * (experts.up_proj_weight[e] @ x[t])
            want += w[t, k] * (experts.down_proj_weight[e] @ h)
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def test_grouped_moe_equals_reference_loop_including_empty_experts():
    from dlmc.models.moe import bf16_moe_reference, grouped_moe

    gen = torch.Generator().manual_seed(1)
    num_experts, hidden, inter = 12, 16, 8
    weights = [torch.randn(num_experts, inter, hidden, generator=gen) for _ in range(2)]
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    for tokens in (1, 3, 17):
        x = torch.randn(tokens, hidden, generator=gen)
        ids = torch.randint(0, 5, (tokens, 2), generator=gen)  # experts 5..11 get no tokens
        ids[:, 1] = (ids[:, 0] + 1) % 5
        w = torch.rand(tokens, 2, generator=gen)
        want = bf16_moe_reference(x, ids, w, *weights, down)
        torch.testing.assert_close(grouped_moe(x, ids, w, *weights, down), want)


def _moe_block(dtype=torch.float32, seed=0, **overrides):
    from dlmc.models.moe import MoEBlock

    cfg = LLaDA2Config.from_dict({**TINY_CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    block = MoEBlock(cfg)
    for p in block.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).to(dtype)
    block.gate.weight.normal_(0.0, cfg.hidden_size**-0.5, generator=gen)  # fp32
    block.gate.expert_bias.normal_(0.0, 0.1, generator=gen)
    x = torch.randn(11, cfg.hidden_size, generator=gen).to(dtype)
    return cfg, block, x


def test_unfused_block_is_routed_plus_shared_bit_for_bit():
    _, block, x = _moe_block()
    assert block.shared_expert_id is None
    want = block.experts(x, *block.gate(x)) + block.shared_experts(x)
    assert torch.equal(block(x), want)


def test_fused_shared_expert_matches_unfused_fp32():
    cfg, block, x = _moe_block()
    shared = {p: getattr(block.shared_experts, p).weight.clone() for p in EXPERT_PROJECTIONS}
    want = block(x)
    assert block.fuse_shared_expert() and block.fuse_shared_expert()  # idempotent
    assert block.shared_experts is None and block.shared_expert_id == cfg.num_experts
    assert block.experts.num_experts == cfg.num_experts + 1
    for proj in EXPERT_PROJECTIONS:
        stacked = getattr(block.experts, f"{proj}_weight")
        assert stacked.shape[0] == cfg.num_experts + 1
        assert torch.equal(stacked[cfg.num_experts], shared[proj])
    names = {n for n, _ in block.named_parameters()}
    assert not any("shared_experts" in n for n in names)
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(block(x), _appended_column(block, x))


def _appended_column(block, x):
    """The fused block's experts on the materialised [T, K+1] routing (the shared expert's id
    and weight 1.0 appended as a column), as the fused block computed it before `shared_expert`."""
    ids, weights = block.gate(x)
    return block.experts(x, append_shared_column(ids, block.shared_expert_id),
                         append_shared_column(weights, 1.0))


def test_fused_shared_expert_matches_unfused_bf16():
    _, block, x = _moe_block(torch.bfloat16, seed=2)
    want = block(x).float()
    block.fuse_shared_expert()
    got = block(x).float()  # fp32 sum of routed + shared instead of a bf16 addition
    assert (got - want).norm() / want.norm() < 1e-2


def test_fused_shared_expert_through_the_triton_op(monkeypatch):
    """MoEBlock's fused routing (id E for every token, weight 1.0) through `dlmc::bf16_moe`
    (on CUDA, or Triton's interpreter on CPU) against the unfused block, and bit for bit against
    the op on the materialised [T, K+1] routing."""
    import dlmc.models.moe as moe

    _, block, x = _moe_block(torch.bfloat16, seed=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block, x = block.to(device), x.to(device)
    want = block(x).float()
    block.fuse_shared_expert()
    monkeypatch.setattr(moe, "grouped_moe", moe.bf16_moe)
    got = block(x)
    assert torch.equal(got, _appended_column(block, x))
    got = got.float()
    assert (got - want).norm() / want.norm() < 1e-2


def test_shared_expert_of_another_width_stays_unfused():
    _, block, x = _moe_block(num_shared_experts=2)
    want = block(x)
    assert not block.fuse_shared_expert()
    assert block.shared_experts is not None and block.shared_expert_id is None
    assert torch.equal(block(x), want)


def _nvfp4_block(seed=4, use_reference=False):
    """A bf16 MoE block whose routed experts are its BF16 experts quantized to NVFP4 (the repo's
    quantizer, as the export does), and 13 tokens."""
    from dlmc.models.nvfp4_experts import NVFP4Experts
    from dlmc.quant.nvfp4_format import quantize_nvfp4

    cfg, block, x = _moe_block(torch.bfloat16, seed=seed)
    experts = NVFP4Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                           use_reference=use_reference)
    for proj in EXPERT_PROJECTIONS:
        stacked = getattr(block.experts, f"{proj}_weight")  # [E, out, in] bf16
        for e in range(cfg.num_experts):
            packed, block_scale, scale_2 = quantize_nvfp4(stacked[e])
            getattr(experts, f"{proj}_weight")[e] = packed
            getattr(experts, f"{proj}_weight_scale")[e] = block_scale
            getattr(experts, f"{proj}_weight_scale_2")[e] = scale_2
    block.experts = experts
    return cfg, block, torch.cat([x, x[:2] * 4])


@pytest.mark.parametrize("use_reference", [False, True])
@torch.no_grad()
def test_fused_nvfp4_shared_expert_matches_unfused(monkeypatch, use_reference):
    """NVFP4 experts take the shared expert as the BF16 tail blocks of `nvfp4_moe` (the op on
    CUDA or under Triton's interpreter on CPU, or the reference): the unfused block's result up
    to the fp32 sum (it rounds the routed sum to bf16 and adds the shared output in bf16) and
    the GEMMs' summation order."""
    cfg, block, x = _nvfp4_block(use_reference=use_reference)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the op compiled on a GPU
    block, x = block.to(device), x.to(device)
    shared = block.shared_experts
    routed, shared_out = block.experts(x, *block.gate(x)).float(), shared(x).float()
    want = block(x).float()
    assert torch.equal(want, (routed.bfloat16() + shared_out.bfloat16()).float())
    assert block.fuse_shared_expert() and block.fuse_shared_expert()  # idempotent
    assert block.shared_experts is None and block.shared_expert_id == cfg.num_experts
    assert block.experts.num_experts == cfg.num_experts  # the routed experts stay packed
    assert torch.equal(block.experts.shared_up_proj_weight, shared.up_proj.weight)
    assert not any("shared" in n for n in block.state_dict())  # runtime buffers only
    got = block(x).float()
    # The same bf16 expert outputs (here bit for bit: tiny GEMMs), summed in fp32 and rounded
    # once; the unfused block rounds the routed sum and then routed + shared: the results differ
    # by at most those two roundings and the fused one (half an ulp each).
    bound = (bf16_ulp(routed) + bf16_ulp(want) + bf16_ulp(got)) / 2
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().amax() > 0  # the roundings do differ somewhere


@torch.no_grad()
def test_nvfp4_combine_outside_matches_the_kernel(monkeypatch):
    """Where a round is compiled the NVFP4 experts return the op's pair rows and sum them
    with pointwise torch ops (for Inductor to fuse into the residual add and RMSNorm). Under the
    interpreter both sums round each product and each add in fp32 in pair order: the same
    values; compiled (fullgraph, AOT with the op's fake) too. Eager calls keep the kernel."""
    from dlmc.custom_ops import moe_combine

    cfg, block, x = _nvfp4_block()
    assert block.fuse_shared_expert()
    want = block(x)
    calls, pointwise = [], moe_combine.combine_pointwise
    monkeypatch.setattr(moe_combine, "combine_pointwise",
                        lambda rows, *args: calls.append(rows.shape) or pointwise(rows, *args))
    assert torch.equal(block(x), want)
    assert calls == []  # eager: the one combine launch
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), want)
    assert calls == [(x.shape[0] * (cfg.num_experts_per_tok + 1), x.shape[1])]  # pair rows
    torch._dynamo.reset()


@pytest.mark.gpu
@torch.no_grad()
def test_nvfp4_combine_outside_compiled_and_replayed_on_cuda(monkeypatch):
    """On CUDA: the NVFP4 block, the residual add and the RMSNorm after it, compiled by Inductor
    (fullgraph) and replayed as a CUDA graph. The op's body runs no combine launch, and the block's
    output is the eager block's (the combine kernel) within one bf16 rounding (FMA contraction may
    differ); the sum and norm after it as close."""
    from dlmc.custom_ops import _nvfp4_moe_launch as op_module
    from dlmc.models.layers import rms_norm
    from tests.custom_ops.graph_capture import compile_and_capture

    cfg, block, x = _nvfp4_block()
    assert block.fuse_shared_expert()
    block, x = block.cuda(), x.cuda()
    gen = torch.Generator(device="cuda").manual_seed(7)
    residual = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    weight = (torch.rand(x.shape[1], device="cuda", generator=gen) + 0.5).bfloat16()

    def layer(x, residual):
        moe = block(x)
        h = moe + residual
        return moe, h, rms_norm(h, weight, 1e-6)

    def check(got, x, residual):
        moe, h, normed = (t.float() for t in layer(x, residual))  # eager: the combine kernel
        got_moe, got_h, got_normed = (t.float() for t in got)
        assert ((got_moe - moe).abs() <= bf16_ulp(moe)).all()
        assert ((got_h - h).abs() <= bf16_ulp(h) + bf16_ulp(moe)).all()
        rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)  # [T, 1]
        bound = 2 * bf16_ulp(normed) + weight.float().abs() * rstd * 2 * bf16_ulp(moe)
        assert ((got_normed - normed).abs() <= bound).all()

    launches = []
    combine_pairs = op_module.combine_pairs
    monkeypatch.setattr(op_module, "combine_pairs",
                        lambda *a, **k: launches.append(1) or combine_pairs(*a, **k))
    torch._dynamo.reset()
    graph, outputs = compile_and_capture(layer, x, residual)
    assert launches == []  # the pair rows are summed outside the op
    for seed in range(2):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen).bfloat16() * (1 + seed))
        residual.copy_(torch.randn(x.shape, device="cuda", generator=gen).bfloat16())
        graph.replay()
        check([o.clone() for o in outputs], x, residual)
    torch._dynamo.reset()


def bf16_ulp(t):
    """The bf16 spacing at each value of `t` (normal range)."""
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(2.0**-126))) - 7)
