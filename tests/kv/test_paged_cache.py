"""`PagedKVCache`: a multi-block decode against dense attention; FP8 vs BF16; capacity errors."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from dlmc.custom_ops.paged_attention_flashinfer import flashinfer_available
from dlmc.errors import ConfigError
from dlmc.kv import KVCacheConfig, PagedKVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, HQ, HKV, D, BLOCK = 2, 4, 2, 64, 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """q `[T, Hq, D]` over every key `[S, Hkv, D]`, fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("thd,shd->hts", q.float(), k) * scale, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def decode_blocks(cache: PagedKVCache, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Run `num_blocks` blocks through every layer, appending each; outputs vs dense attention."""
    gen = torch.Generator().manual_seed(seed)
    history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(LAYERS)]
    errors = []
    for _ in range(num_blocks):
        cache.check_capacity(BLOCK)
        cache.plan(BLOCK, softmax_scale=D**-0.5)
        for layer in range(LAYERS):
            q, k, v = (torch.randn(BLOCK, h, D, generator=gen).bfloat16().to(DEVICE)
                       for h in (HQ, HKV, HKV))
            out = cache.attend(layer, q, k, v, softmax_scale=D**-0.5)  # [T, Hq, D]
            cache.append(layer, k, v)
            history[layer].append((k, v))
            keys = torch.cat([kk for kk, _ in history[layer]])
            values = torch.cat([vv for _, vv in history[layer]])
            ref = dense_attention(q, keys, values, D**-0.5)
            errors.append((out.float() - ref).abs().max() / ref.abs().max())
        cache.advance(BLOCK)
    return errors


def make_cache(dtype: Literal["bf16", "fp8"], backend: str, max_tokens: int = 40,
               fused_append: bool | None = None) -> PagedKVCache:
    config = KVCacheConfig(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                           max_tokens=max_tokens, page_size=4, dtype=dtype)
    scales = [0.02, 0.01] if dtype == "fp8" else None
    return PagedKVCache(config, DEVICE, k_scales=scales, v_scales=scales, backend=backend,
                        num_q_heads=HQ, fused_append=fused_append)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bf16_cache_matches_dense_attention(backend: str) -> None:
    errors = decode_blocks(make_cache("bf16", backend), num_blocks=4)
    assert max(errors) < 0.02


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_cache_within_fp8_error(backend: str) -> None:
    errors = decode_blocks(make_cache("fp8", backend), num_blocks=4)
    assert errors[0] < 0.02  # first block: no cached tokens, the block itself stays BF16
    assert max(errors) < 0.1  # E4M3 keeps 3 mantissa bits: a few percent


def test_backends_agree() -> None:
    outs = []
    for backend in ("reference", "triton"):
        cache = make_cache("fp8", backend)
        decode_blocks(cache, num_blocks=2)
        outs.append((torch.stack(cache.k).view(torch.uint8).clone(), cache.length))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == 2 * BLOCK


def test_capacity_error_names_the_option() -> None:
    cache = make_cache("bf16", "reference", max_tokens=20)  # 5 pages of 4
    cache.advance(16)
    with pytest.raises(ConfigError, match="max_tokens=20"):
        cache.check_capacity(BLOCK)
    with pytest.raises(ConfigError, match="max_tokens=20"):
        cache.advance(BLOCK)
    cache.reset()
    assert cache.length == 0 and int(cache.prefix_len) == 0


def test_config_and_option_errors() -> None:
    with pytest.raises(ConfigError, match="KVCacheConfig.page_size"):
        KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=8, page_size=0)
    with pytest.raises(ConfigError, match="KVCacheConfig.dtype"):
        KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=8,
                      dtype="fp16")  # type: ignore[arg-type]
    config = KVCacheConfig(num_layers=2, num_kv_heads=1, head_dim=64, max_tokens=8, dtype="fp8")
    with pytest.raises(ConfigError, match="k_scales must be 2"):
        PagedKVCache(config, DEVICE, k_scales=[1.0])
    with pytest.raises(ConfigError, match="backend='tpu'"):
        PagedKVCache(config, DEVICE, backend="tpu")


@pytest.mark.skipif(flashinfer_available(), reason="flashinfer is installed here")
def test_flashinfer_missing_names_the_option() -> None:
    config = KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=128, max_tokens=8)
    with pytest.raises(ConfigError, match="backend='flashinfer'"):
        PagedKVCache(config, DEVICE, backend="flashinfer", num_q_heads=1)


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer (see README)")
def test_flashinfer_backend_matches_triton() -> None:
    outs = []
    for backend in ("triton", "flashinfer"):
        config = KVCacheConfig(num_layers=1, num_kv_heads=4, head_dim=128, max_tokens=4096,
                               dtype="fp8")
        cache = PagedKVCache(config, "cuda", k_scales=[0.02], v_scales=[0.02],
                             backend=backend, num_q_heads=16)
        gen = torch.Generator(device="cuda").manual_seed(0)
        history = torch.randn(3000, 4, 128, device="cuda", generator=gen).bfloat16()
        cache.append(0, history, history)
        cache.advance(3000)
        cache.plan(32, softmax_scale=128**-0.5)
        q = torch.randn(32, 16, 128, device="cuda", generator=gen).bfloat16()
        k = torch.randn(32, 4, 128, device="cuda", generator=gen).bfloat16()
        outs.append(cache.attend(0, q, k, k, softmax_scale=128**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=0.05 * outs[0].abs().max().item(),
                               rtol=0.05)


def decode_with_append(cache: PagedKVCache, num_blocks: int, seed: int = 0
                       ) -> list[torch.Tensor]:
    """`append_and_attend` on every layer of `num_blocks` blocks (as rounds do); the outputs."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(num_blocks):
        cache.check_capacity(BLOCK)
        for layer in range(LAYERS):
            q, k, v = (torch.randn(BLOCK, h, D, generator=gen).bfloat16().to(DEVICE)
                       for h in (HQ, HKV, HKV))
            outs.append(cache.append_and_attend(layer, q, k, v, softmax_scale=D**-0.5))
        cache.advance(BLOCK)
    return outs


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_fused_append_matches_append_then_attend(dtype: Literal["bf16", "fp8"]) -> None:
    """One launch (Triton) vs kv_append + attention vs the reference backend: the same cache
    bytes; the fused and separate Triton outputs are identical."""
    caches = {"fused": make_cache(dtype, "triton", fused_append=True),
              "separate": make_cache(dtype, "triton", fused_append=False),
              "reference": make_cache(dtype, "reference", fused_append=True)}
    assert caches["fused"].fused_append and not caches["separate"].fused_append
    assert not caches["reference"].fused_append  # the reference appends, then attends
    outs = {name: decode_with_append(cache, num_blocks=2) for name, cache in caches.items()}
    for name in ("separate", "reference"):
        for mine, theirs in zip(caches["fused"].k + caches["fused"].v,
                                caches[name].k + caches[name].v, strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(outs["fused"], outs["separate"], strict=True))
    for a, b in zip(outs["fused"], outs["reference"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.02 * b.abs().max().item(),
                                   rtol=0.02)


def test_where_a_cache_stores_its_rounds_kv() -> None:
    """BF16 caches on the Triton backend store K/V from the attention's kernel (one launch);
    FP8 caches from the model's norm/rope launch (`rope_append_target`: the layer's pools,
    table, prefix length and scales); the reference appends, then attends; a constructor's
    `fused_append` wins."""
    assert make_cache("bf16", "triton").fused_append
    assert not make_cache("fp8", "triton").fused_append
    assert not make_cache("bf16", "reference").fused_append  # append, then attend
    assert make_cache("fp8", "triton", fused_append=True).fused_append
    assert not make_cache("fp8", "reference", fused_append=True).fused_append
    cache = make_cache("fp8", "triton")
    assert cache.rope_append
    target = cache.rope_append_target(1)
    want = (cache.k[1], cache.v[1], cache.page_table, cache.prefix_len, cache.k_scale[1],
            cache.v_scale[1])
    assert [(t.data_ptr(), t.shape, t.dtype) for t in target] == [
        (t.data_ptr(), t.shape, t.dtype) for t in want]  # the same tensors (views)
    assert make_cache("bf16", "triton").rope_append_target(0) is None  # the attention stores
    assert make_cache("bf16", "triton", fused_append=False).rope_append
    assert not make_cache("fp8", "reference").rope_append
    assert make_cache("fp8", "reference").rope_append_target(0) is None
