"""`KernelConfig.fused_attention_in` in the LLaDA2 model: every layer's input half through one
`dlmc::attention_in(_append)` launch gives the logits (and FP8 cache) of the plain path.

The tiny BF16 model on CPU (the op under Triton's interpreter). The plain path rounds qkv from
a bf16 `F.linear`, the op from its fp32 split-K sum, so a few bf16 values round the other way;
20 layers' worth of those stay far below the bound (relative norm of the logits' difference
< 1e-2, the split-K test's 2e-2 halved).
"""

import pytest
import torch

import dlmc.models.llada2 as llada2
from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.kv.attention import MaskedAttention, block_causal_mask
from dlmc.kv.paged_cache import KVCacheConfig, PagedKVCache
from dlmc.loading.loader import load_model
from dlmc.models.nvfp4_experts import apply_kernel_config

# CPU tensors take the op only under the interpreter (a GPU machine runs the op's own GPU tests)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU)")


class AppendingContext:
    """A paged FP8 cache (reference attention) whose block K/V the model stores from its
    norm/rope launch: `qk_norm_rope_append` on the plain path, `attention_in_append` fused."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def rope_append_target(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        c = self.cache
        return (c.k[layer_idx], c.v[layer_idx], c.page_table, c.prefix_len,
                c.k_scale[layer_idx], c.v_scale[layer_idx])

    def attend_appended(self, layer_idx, q, k, v):
        return self.cache.attend(layer_idx, q, k, v, softmax_scale=q.shape[-1] ** -0.5)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(tiny_dir, torch.device("cpu"), torch.bfloat16)


def _count_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("attention_in", "attention_in_append"):
        op = getattr(llada2, name)
        monkeypatch.setattr(llada2, name,
                            lambda *a, op=op, name=name: calls.append(name) or op(*a))
    return calls


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_fused_logits_match_the_plain_path(loaded, monkeypatch):
    """Block-causal attention over a whole sequence (no cache): one `attention_in` per layer."""
    model, layers = loaded.model, loaded.config.num_hidden_layers
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(24)
    ctx = MaskedAttention(block_causal_mask(pos, pos, 8, torch.bfloat16))
    calls = _count_calls(monkeypatch)
    logits = {}
    try:
        for fused in (False, True):
            apply_kernel_config(model, KernelConfig(fused_attention_in=fused))
            with torch.inference_mode():
                logits[fused] = model(ids, pos, ctx)
    finally:
        apply_kernel_config(model, KernelConfig())
    assert calls == ["attention_in"] * layers
    assert _rel(logits[True], logits[False]) < 1e-2


def test_fused_append_fills_the_fp8_cache_as_the_plain_path(loaded, monkeypatch):
    """A prefix, then a block over the paged FP8 cache: the same logits within the bound, and
    caches that dequantize to the same K/V within FP8 rounding."""
    model, cfg = loaded.model, loaded.config
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4))
    calls = _count_calls(monkeypatch)
    results = {}
    try:
        for fused in (False, True):
            apply_kernel_config(model, KernelConfig(fused_attention_in=fused))
            cache = PagedKVCache(
                KVCacheConfig(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                              64, page_size=4, dtype="fp8"), "cpu", backend="reference",
                k_scales=[0.05] * cfg.num_hidden_layers, v_scales=[0.02] * cfg.num_hidden_layers)
            ctx = AppendingContext(cache)
            with torch.inference_mode():
                model(ids[:9], torch.arange(9), ctx, compute_logits=False)
                cache.advance(9)
                logits = model(ids[9:], torch.arange(9, 20), ctx)
            results[fused] = (logits, torch.stack(cache.k).float(), torch.stack(cache.v).float())
    finally:
        apply_kernel_config(model, KernelConfig())
    assert calls == ["attention_in_append"] * (2 * cfg.num_hidden_layers)
    (want, k_want, v_want), (got, k_got, v_got) = results[False], results[True]
    assert _rel(got, want) < 1e-2
    for g, w in ((k_got, k_want), (v_got, v_want)):
        assert _rel(g, w) < 2e-2  # an FP8 step (2^-3 relative) on the few flipped values
        assert (g == w).float().mean().item() > 0.9
