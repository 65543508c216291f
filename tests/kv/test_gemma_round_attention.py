"""DiffusionGemma's static-cache contexts against the reference contexts
(`dlmc.models.diffusion_gemma_attention`) on a tiny fp32 model whose sliding windows are shorter
than the context: encoder chunks (written at device-side positions), then canvases attending to
the cache with its device-side length, in both key layouts (bucket slots, gathered window); at
the exact cache length (the eager stepper's calls) the reference's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from dlmc.kv.gemma_round_attention import ALIGN, CanvasRoundAttention, EncodeRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache
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
