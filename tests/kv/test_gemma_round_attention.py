"""DiffusionGemma's static-cache contexts against the reference contexts
(`dlmc.models.diffusion_gemma_attention`) on a tiny fp32 model whose sliding windows are shorter
than the context: encoder chunks (written at device-side positions), then canvases attending to
the cache with its device-side length, in both key layouts (bucket slots, gathered window); at
the exact cache length (the eager stepper's calls) the reference's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from dlmc.errors import ConfigError
from dlmc.kv.gemma_round_attention import ALIGN, CanvasRoundAttention, EncodeRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma_attention import (
    CanvasContext,
    CausalContext,
    GemmaKVCache,
    gemma_attention_reference,
)
from tests.models.gemma_tiny import CANVAS, VOCAB, tiny_model

MAX_TOKENS = 64


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _static_cache(model, seed: int) -> GemmaStaticCache:
    """A cache whose every slot holds garbage (stale K/V must never be attended)."""
    cache = GemmaStaticCache(model.config, MAX_TOKENS, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.copy_(100 * torch.randn(t.shape, generator=gen))
    return cache


@pytest.mark.parametrize(("seed", "window", "chunks", "bucket"), [
    (0, 5, (6, 7), False),  # windows of 4 cached keys: the gathered window
    (1, 5, (6, 7), True),  # the same in bucket slots (key_len = what the chunk needs)
    (2, 3, (13,), False),
    (3, 16, (5, 8), False),  # a window longer than the context
    (4, 7, (1, 9, 3), True),
])
@torch.no_grad()
def test_encoder_and_canvas_contexts_equal_the_reference(seed, window, chunks, bucket):
    model = tiny_model(seed, sliding_window=window)
    gen = torch.Generator().manual_seed(100 + seed)
    reference = GemmaKVCache(model.config.num_hidden_layers)
    cache = _static_cache(model, seed)
    start, errors = 0, []
    for size in chunks:
        ids = torch.randint(0, VOCAB, (size,), generator=gen)
        positions = torch.arange(start, start + size)
        want = model(ids, positions, CausalContext(reference))
        key_len = start + size if bucket else MAX_TOKENS
        got = model(ids, positions, EncodeRoundAttention(cache, positions, key_len))
        errors.append(_rel(got, want))
        start += size
        cache.length.fill_(start)
    # the chunks' K/V, where they belong (layer 0's exactly: the same input and weights)
    assert torch.equal(cache.k[0][:start], reference.keys[0])
    for layer in range(model.config.num_hidden_layers):
        errors.append(_rel(cache.k[layer][:start], reference.keys[layer]))
        errors.append(_rel(cache.v[layer][:start], reference.values[layer]))
    before = [t.clone() for t in cache.k]
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    positions = torch.arange(start, start + CANVAS)
    sc = None
    for _ in range(2):  # with and without self-conditioning
        want = model(canvas, positions, CanvasContext(reference), decoder=True,
                     self_conditioning_logits=sc)
        for key_len in ({start, MAX_TOKENS} if bucket else {MAX_TOKENS}):
            got = model(canvas, positions, CanvasRoundAttention(cache, key_len), decoder=True,
                        self_conditioning_logits=sc)
            errors.append(_rel(got, want))
        sc = want / 0.8
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k, strict=True))  # read only
    assert max(errors) < 1e-5, errors


@torch.no_grad()
def test_padding_past_the_length_is_never_attended():
    """A chunk padded at its end writes K/V past the real tokens; with the length at the real
    tokens' end, canvases and the next chunk see exactly what an unpadded encoder made."""
    model = tiny_model(5)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (11,), generator=gen)
    reference = GemmaKVCache(model.config.num_hidden_layers)
    model(prompt, torch.arange(11), CausalContext(reference))
    cache = _static_cache(model, 5)
    padded = torch.cat([prompt, torch.randint(0, VOCAB, (5,), generator=gen)])  # 16 tokens
    model(padded, torch.arange(16), EncodeRoundAttention(cache, torch.arange(16), 16),
          compute_logits=False)
    cache.length.fill_(11)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    at = torch.arange(11, 11 + CANVAS)
    want = model(canvas, at, CanvasContext(reference), decoder=True)
    got = model(canvas, at, CanvasRoundAttention(cache, 32), decoder=True)
    assert _rel(got, want) < 1e-5
    # the canvas encoded over the padding's slots
    want = model(canvas, at, CausalContext(reference))
    got = model(canvas, at, EncodeRoundAttention(cache, at, 32))
    assert _rel(got, want) < 1e-5


def test_cache_shapes_follow_the_layer_kinds():
    model = tiny_model(0)
    cache = GemmaStaticCache(model.config, 40, torch.bfloat16, "cpu")
    assert [tuple(k.shape) for k in cache.k] == [(40, 2, 16), (40, 2, 16), (40, 1, 32)] * 2
    assert [tuple(v.shape) for v in cache.v] == [tuple(k.shape) for k in cache.k]
    assert cache.windows == [5, 5, None] * 2 and cache.length.item() == 0
    assert cache.nbytes() == 2 * 40 * 2 * (4 * 32 + 2 * 32)
    assert len({k.data_ptr() for k in (*cache.k, *cache.v)}) == 12  # one allocation each


@torch.no_grad()
@pytest.mark.parametrize("length", [3, 4, 5, 11])
def test_exact_key_length_is_the_reference_bit_for_bit(length):
    """With `key_len` the cache length (no bucket), a canvas attends to the keys the reference
    reads, in its order, unmasked: the same logits bit for bit over the same K/V. So is a first
    encoder chunk (the keys 0 .. T - 1 under the same causal, windowed mask). Past `ALIGN` slots
    (length 11) the window is gathered as `ALIGN` slots for `WINDOW - 1` keys, the rest masked:
    the same to rounding."""
    model = tiny_model(7)
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (length,), generator=gen)
    reference = GemmaKVCache(model.config.num_hidden_layers)
    positions = torch.arange(length)
    want = model(ids, positions, CausalContext(reference))
    cache = _static_cache(model, length)
    got = model(ids, positions, EncodeRoundAttention(cache, positions, length))
    assert torch.equal(got, want)
    for layer in range(model.config.num_hidden_layers):  # the reference's K/V, exactly
        cache.k[layer][:length] = reference.keys[layer]
        cache.v[layer][:length] = reference.values[layer]
    cache.length.fill_(length)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    at = torch.arange(length, length + CANVAS)
    want = model(canvas, at, CanvasContext(reference), decoder=True)
    exact = model(canvas, at, CanvasRoundAttention(cache, length), decoder=True)
    if length > ALIGN:  # the gathered window holds one masked slot
        assert _rel(exact, want) < 1e-5
    else:
        assert torch.equal(exact, want)
    bucket = model(canvas, at, CanvasRoundAttention(cache, MAX_TOKENS), decoder=True)
    assert _rel(bucket, want) < 1e-5  # masked slots: the same to rounding


@torch.no_grad()
def test_the_window_matters():
    """Canvas logits over a cache longer than the window change if the window is ignored."""
    model = tiny_model(8)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(8))
    cache = _static_cache(model, 8)
    model(ids, torch.arange(20), EncodeRoundAttention(cache, torch.arange(20), 20))
    cache.length.fill_(20)
    canvas, at = ids[:CANVAS], torch.arange(20, 20 + CANVAS)
    windowed = model(canvas, at, CanvasRoundAttention(cache, 20), decoder=True)

    class Unwindowed(CanvasRoundAttention):
        def attend(self, layer_idx, q, k, v, window, scale):
            return super().attend(layer_idx, q, k, v, None, scale)

    whole = model(canvas, at, Unwindowed(cache, 20), decoder=True)
    assert _rel(windowed, whole) > 1e-3


@torch.no_grad()
@pytest.mark.parametrize(("fp8", "length"), [(False, 3), (False, 11), (True, 30), (True, 57)])
def test_paged_attention_path_equals_the_torch_path(fp8, length):
    """`triton=True` attends through `dlmc::paged_attention` (the Triton interpreter on CPU) over
    the cache viewed as pages: every layer kind (window 5 and full, head dims 16 and 32) gives
    the torch path's (in fp32) to bf16 rounding, with stale slots past the length never read."""
    model = tiny_model(9)
    scales = KVScales(k=tuple(0.5 + 0.1 * i for i in range(6)), v=(0.7,) * 6) if fp8 else None
    cache = GemmaStaticCache(model.config, MAX_TOKENS, torch.bfloat16, "cpu", fp8_scales=scales)
    gen = torch.Generator().manual_seed(length)
    positions = torch.arange(MAX_TOKENS)
    for layer in range(6):  # real K/V below the length, huge stale values past it
        shape = cache.k[layer].shape
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        k[length:], v[length:] = 1e3, -1e3
        cache.write(layer, positions, k, v)
    cache.length.fill_(length)
    torch_ctx, triton_ctx = CanvasRoundAttention(cache, 64), CanvasRoundAttention(cache, 64, True)
    for layer in range(6):
        kv_heads, dim = cache.k[layer].shape[1:]
        q = torch.randn(CANVAS, 4, dim, generator=gen).bfloat16()
        k, v = (torch.randn(CANVAS, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
        window = cache.windows[layer]
        want = torch_ctx.attend(layer, q.float(), k.float(), v.float(), window, 1.0)  # fp32
        got = triton_ctx.attend(layer, q, k, v, window, 1.0)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert _rel(got.float(), want) < 2e-2, layer  # the op's tolerance (P in bf16)


def test_paged_attention_path_needs_bf16_activations():
    model = tiny_model(0)
    cache = GemmaStaticCache(model.config, MAX_TOKENS, torch.float32, "cpu")
    q, k = torch.zeros(CANVAS, 4, 16), torch.zeros(CANVAS, 2, 16)
    with pytest.raises(ConfigError, match="gemma_attention='triton' needs bfloat16"):
        CanvasRoundAttention(cache, MAX_TOKENS, True).attend(0, q, k, k, 5, 1.0)


def test_paged_view_is_the_cache_in_order():
    model = tiny_model(0)
    cache = GemmaStaticCache(model.config, 48, torch.bfloat16, "cpu")
    cache.k[2].copy_(torch.arange(48 * 32).reshape(48, 1, 32))
    k_pool, v_pool, table, k_scale, v_scale = cache.paged(2)
    assert tuple(k_pool.shape) == (3, 16, 1, 32) and table.tolist() == [0, 1, 2]
    assert k_pool.data_ptr() == cache.k[2].data_ptr() and v_pool.data_ptr() == cache.v[2].data_ptr()
    assert k_pool[2, 5, 0, 0].item() == (2 * 16 + 5) * 32
    assert k_scale.tolist() == [1.0] and v_scale.dtype == torch.float32


@torch.no_grad()
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_encoder_path_equals_the_torch_path(fp8):
    """An encoder chunk through `dlmc::paged_attention_append` (chunks of 6, 7 and 9 tokens, so
    windows of 5 move across chunk and page boundaries; a sliding and a full layer) stores
    exactly the K/V the torch path stores, and attends the cached rows as stored and its own
    K/V as computed (in fp32: to bf16 rounding)."""
    model = tiny_model(10, torch.bfloat16)
    scales = KVScales(k=(0.5,) * 6, v=(0.25,) * 6) if fp8 else None
    want, got = (GemmaStaticCache(model.config, MAX_TOKENS, torch.bfloat16, "cpu",
                                  fp8_scales=scales) for _ in range(2))
    gen = torch.Generator().manual_seed(10)
    start = 0
    for size in (6, 7, 9):
        positions = torch.arange(start, start + size)
        for layer in (0, 2):
            kv_heads, dim = want.k[layer].shape[1:]
            q = torch.randn(size, 4, dim, generator=gen).bfloat16()
            k, v = (torch.randn(size, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
            window = want.windows[layer]
            # the op's maths in fp32: the cached rows as stored, the chunk's own K/V as given
            past_k, past_v = want.read(layer, want.k[layer][:start], want.v[layer][:start])
            keys, values = torch.cat([past_k, k]).float(), torch.cat([past_v, v]).float()
            slots, query = torch.arange(start + size), positions[:, None]
            allowed = (slots <= query) & (slots > query - (window or MAX_TOKENS))
            expected = gemma_attention_reference(q.float(), keys, values, allowed, 1.0)
            EncodeRoundAttention(want, positions, MAX_TOKENS).attend(layer, q, k, v, window, 1.0)
            out = EncodeRoundAttention(got, positions, MAX_TOKENS, True).attend(
                layer, q, k, v, window, 1.0)
            assert _rel(out.float(), expected) < 2e-2, (size, layer)
            assert torch.equal(got.k[layer].view(torch.uint8), want.k[layer].view(torch.uint8))
            assert torch.equal(got.v[layer].view(torch.uint8), want.v[layer].view(torch.uint8))
        start += size
        want.length.fill_(start)
        got.length.fill_(start)
