"""DiffusionGemma's static cache with FP8 K/V (`GemmaStaticCache(fp8_scales=...)`): what `write`
stores and `read` gives, the decoder's canvas attention over dequantized K/V (each layer's K
scale on K, V scale on V), encoder + canvas logits close to an unquantized cache's, and the
errors for bad scales."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.kv_append import quantize_kv_reference
from dlmc.errors import ConfigError
from dlmc.kv.gemma_round_attention import CanvasRoundAttention, EncodeRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache
from tests.models.gemma_tiny import CANVAS, VOCAB, tiny_model

LAYERS = 6


def _scales(k: float, v: float) -> KVScales:
    return KVScales((k,) * LAYERS, (v,) * LAYERS)


def test_write_stores_e4m3_of_x_over_the_scale_and_read_dequantizes():
    model = tiny_model(0)
    scales = KVScales(tuple(0.01 * (i + 1) for i in range(LAYERS)),
                      tuple(0.02 * (i + 1) for i in range(LAYERS)))
    cache = GemmaStaticCache(model.config, 16, torch.bfloat16, "cpu", fp8_scales=scales)
    assert cache.kv_cache_dtype == "fp8" and cache.k[2].dtype == torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 1, 32, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    v = 10 * torch.randn(4, 1, 32, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    k[0, 0, 0] = 1e4  # past 448 * scale: saturates to 448, never NaN
    positions = torch.tensor([3, 4, 5, 6])
    cache.write(2, positions, k, v)  # layer 2: full, scales 0.03 / 0.06
    want_k = quantize_kv_reference(k, torch.tensor(0.03), torch.float8_e4m3fn)
    want_v = quantize_kv_reference(v, torch.tensor(0.06), torch.float8_e4m3fn)
    assert torch.equal(cache.k[2][3:7].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(cache.v[2][3:7].view(torch.uint8), want_v.view(torch.uint8))
    assert float(cache.k[2][3, 0, 0].float()) == 448.0
    got_k, got_v = cache.read(2, cache.k[2][3:7], cache.v[2][3:7])
    assert got_k.dtype == torch.bfloat16
    assert torch.equal(got_k, (want_k.float() * 0.03).to(torch.bfloat16))
    assert torch.equal(got_v, (want_v.float() * 0.06).to(torch.bfloat16))
    rel = ((got_v.float() - v.float()).abs() / v.float().abs().clamp(min=1.0)).max()
    assert 0 < rel < 0.07  # e4m3: 3 mantissa bits
    plain = GemmaStaticCache(model.config, 16, torch.bfloat16, "cpu")
    assert plain.kv_cache_dtype == "bfloat16" and plain.k[0].dtype == torch.bfloat16
    plain.write(2, positions, k, v)
    assert torch.equal(plain.read(2, plain.k[2][3:7], plain.v[2][3:7])[0], k)


@pytest.mark.parametrize(("k_scale", "v_scale"), [(4.0, 0.25), (0.25, 4.0)])
@torch.no_grad()
def test_canvas_attention_reads_k_with_k_scale_and_v_with_v_scale(k_scale, v_scale):
    """The same FP8 codes read with swapped scales: each order equals the reference context over
    `codes * k_scale`, `codes * v_scale`, and the two orders' logits differ."""
    model = tiny_model(1)
    prefix = 9
    gen = torch.Generator().manual_seed(1)
    cache = GemmaStaticCache(model.config, 32, torch.float32, "cpu",
                             fp8_scales=_scales(k_scale, v_scale))
    reference = GemmaKVCache(LAYERS)
    for layer in range(LAYERS):
        for codes in (cache.k[layer], cache.v[layer]):
            codes.copy_(torch.randn(codes.shape, generator=gen).to(torch.float8_e4m3fn))
        reference.append(layer, cache.k[layer][:prefix].float() * k_scale,
                         cache.v[layer][:prefix].float() * v_scale)
    cache.length.fill_(prefix)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    positions = torch.arange(prefix, prefix + CANVAS)
    got = model(canvas, positions, CanvasRoundAttention(cache, prefix), decoder=True)
    want = model(canvas, positions, CanvasContext(reference), decoder=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    swapped = GemmaStaticCache(model.config, 32, torch.float32, "cpu",
                               fp8_scales=_scales(v_scale, k_scale))
    for layer in range(LAYERS):
        swapped.k[layer].copy_(cache.k[layer])
        swapped.v[layer].copy_(cache.v[layer])
    swapped.length.fill_(prefix)
    other = model(canvas, positions, CanvasRoundAttention(swapped, prefix), decoder=True)
    assert (other - got).abs().max() > 0.1


class FakeQuantCausal(CausalContext):
    """The reference encoder context over K/V rounded as an FP8 cache stores them."""

    def __init__(self, cache: GemmaKVCache, scales: KVScales) -> None:
        super().__init__(cache)
        self.scales = scales

    def attend(self, layer_idx, q, k, v, window, scale):
        k = _rounded(k, self.scales.k[layer_idx])
        v = _rounded(v, self.scales.v[layer_idx])
        return super().attend(layer_idx, q, k, v, window, scale)


def _rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    codes = quantize_kv_reference(x, torch.tensor(scale), torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


def _passes(model, context_of, gen, chunks=(7, 6)) -> list[torch.Tensor]:
    """Encoder chunks, then a canvas step: their logits, each context from `context_of(kind,
    positions, end)`."""
    start, out = 0, []
    for size in chunks:
        ids = torch.randint(0, VOCAB, (size,), generator=gen)
        positions = torch.arange(start, start + size)
        out.append(model(ids, positions, context_of("encode", positions, start + size)))
        start += size
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    positions = torch.arange(start, start + CANVAS)
    out.append(model(canvas, positions, context_of("canvas", positions, start), decoder=True))
    return out


def _static(cache: GemmaStaticCache, key_len: int | None):
    def context_of(kind, positions, end):
        if kind == "encode":
            cache.length.fill_(int(positions[0]))
            context = EncodeRoundAttention(cache, positions, key_len or end)
            cache.length.fill_(end)  # moved once the chunk is encoded (read on the device)
            return context
        return CanvasRoundAttention(cache, key_len or end)
    return context_of


@pytest.mark.parametrize("key_len", [None, 40])  # the exact length; a bucket
@torch.no_grad()
def test_fp8_cache_passes_equal_the_reference_over_rounded_kv(key_len):
    """Encoder chunks (which attend their own K/V as stored) and the canvas step over an FP8
    cache equal the reference contexts fed K/V rounded to e4m3 with the same scales."""
    model = tiny_model(3)
    scales = KVScales(tuple(0.004 * (i + 1) for i in range(LAYERS)),
                      tuple(0.003 * (i + 2) for i in range(LAYERS)))
    cache = GemmaStaticCache(model.config, 40, torch.float32, "cpu", fp8_scales=scales)
    reference = GemmaKVCache(LAYERS)

    def reference_of(kind, positions, end):
        return FakeQuantCausal(reference, scales) if kind == "encode" else CanvasContext(reference)

    want = _passes(model, reference_of, torch.Generator().manual_seed(3))
    got = _passes(model, _static(cache, key_len), torch.Generator().manual_seed(3))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_fp8_cached_logits_are_close_to_an_unquantized_cache():
    """The same passes over an FP8 cache (scales 0.01, about amax / 448 of the normed K and V)
    and over an fp32 cache, every expert routed (no top-k flips): canvas logits (range about
    +-3 to 5) within 1.5 at worst and 0.25 on average; the e4m3 rounding (up to 1/16 of a
    value) compounds over the tiny random model's layers (a bf16 cache: about 0.5 and 0.08)."""
    for seed in range(3):
        model = tiny_model(seed, top_k_experts=8)
        caches = [GemmaStaticCache(model.config, 40, torch.float32, "cpu"),
                  GemmaStaticCache(model.config, 40, torch.float32, "cpu",
                                   fp8_scales=_scales(0.01, 0.01))]
        plain, fp8 = (_passes(model, _static(c, None), torch.Generator().manual_seed(seed))[-1]
                      for c in caches)
        diff = (fp8 - plain).abs()
        assert plain.abs().max() > 3.0
        assert 0 < diff.max() < 1.5 and diff.mean() < 0.25, (seed, diff.max(), diff.mean())


def test_bad_scales_are_errors():
    config = tiny_model(0).config
    with pytest.raises(ConfigError, match="5 k scales for 6 layers"):
        GemmaStaticCache(config, 8, torch.bfloat16, "cpu",
                         fp8_scales=KVScales((1.0,) * 5, (1.0,) * 6))
    with pytest.raises(ConfigError, match="v_scale of layer 3 is -1.0"):
        GemmaStaticCache(config, 8, torch.bfloat16, "cpu",
                         fp8_scales=KVScales((1.0,) * 6, (1.0, 1.0, 1.0, -1.0, 1.0, 1.0)))
    with pytest.raises(ConfigError, match="k_scale of layer 0 is nan"):
        GemmaStaticCache(config, 8, torch.bfloat16, "cpu",
                         fp8_scales=KVScales((float("nan"),) * 6, (1.0,) * 6))
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer"):
        GemmaStaticCache(config, 0, torch.bfloat16, "cpu", fp8_scales=_scales(1.0, 1.0))
