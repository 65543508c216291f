import torch

from dlmc.loading.tiny import TINY_CONFIG
from dlmc.models.config import LLaDA2Config
from dlmc.models.moe import BF16Experts, Router


def _router(**overrides):
    cfg = LLaDA2Config.from_dict({**TINY_CONFIG, **overrides})
    router = Router(cfg)
    router.weight.data = torch.eye(cfg.num_experts, cfg.hidden_size)
    return cfg, router


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
