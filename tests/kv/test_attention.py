"""`attention_reference` (GQA without repeating K/V) against a per-head loop."""

import pytest
import torch

from dlmc.kv.attention import attention_reference


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_gqa_heads_read_their_kv_head(num_q_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(num_q_heads)
    tokens, keys, dim = 5, 9, 4
    # q non-contiguous, as a view out of a fused projection can be
    q = torch.randn(num_q_heads, tokens, dim, generator=gen, dtype=torch.float64).transpose(0, 1)
    k = torch.randn(keys, num_kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, num_kv_heads, dim, generator=gen, dtype=torch.float64)
    mask = torch.zeros(tokens, keys, dtype=torch.float64)
    mask[:, 7:] = float("-inf")
    out = attention_reference(q, k, v, mask, scale=0.3)
    group = num_q_heads // num_kv_heads
    for h in range(num_q_heads):
        kv = h // group
        probs = torch.softmax(q[:, h] @ k[:, kv].T * 0.3 + mask, dim=-1)
        # the reference's softmax runs in fp32
        torch.testing.assert_close(out[:, h], probs @ v[:, kv], rtol=1e-5, atol=1e-6)
    assert out.shape == (tokens, num_q_heads, dim)
