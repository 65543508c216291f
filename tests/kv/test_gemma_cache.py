"""DiffusionGemma's dense cache and its encoder / canvas contexts against the model's reference
contexts (which keep every position and mask by position), on the tiny checkpoint: encoder
logits and cached K/V in chunks that the sliding window crosses, decoder logits."""

import pytest
import torch

from dlmc.errors import ConfigError
from dlmc.kv.gemma_cache import CanvasAttention, EncoderAttention, GemmaDenseCache, window_start
from dlmc.loading.loader import load_model
from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gemma_checkpoint(tmp_path_factory.mktemp("g"), seed=2, shards=1,
                                       tokenizer=False, sliding_window=7)
    return load_model(path, torch.device("cpu"), torch.float32).model


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[30], [4, 9, 17], [1] * 30])
def test_chunked_encoder_and_canvas_match_the_reference(model, chunks):
    gen = torch.Generator().manual_seed(len(chunks))
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=gen)
    canvas = torch.randint(0, model.config.vocab_size, (32,), generator=gen)
    ref_cache = GemmaKVCache(model.config.num_hidden_layers)
    want = model(ids, torch.arange(30), CausalContext(ref_cache))  # [30, V] one pass
    cache = GemmaDenseCache.for_config(model.config, 40, torch.float32, torch.device("cpu"))
    start, got = 0, []
    for size in chunks:
        part = ids[start:start + size]
        got.append(model(part, torch.arange(start, start + size), EncoderAttention(cache, start)))
        start += size
        cache.length = start
    assert _rel(torch.cat(got), want) < 1e-5
    for layer in range(model.config.num_hidden_layers):
        k, v = cache.read(layer, 0, 30)
        assert _rel(k, ref_cache.keys[layer]) < 1e-5 and _rel(v, ref_cache.values[layer]) < 1e-5
    positions = torch.arange(30, 62)
    want = model(canvas, positions, CanvasContext(ref_cache), decoder=True)
    got = model(canvas, positions, CanvasAttention(cache, 30), decoder=True)
    assert _rel(got, want) < 1e-5
    assert cache.length == 30  # the canvas pass does not write


@torch.no_grad()
def test_the_window_matters(model):
    """Canvas logits over a cache longer than the window change if the window is ignored."""
    ids = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator())
    cache = GemmaDenseCache.for_config(model.config, 20, torch.float32, torch.device("cpu"))
    model(ids, torch.arange(20), EncoderAttention(cache, 0))
    cache.length = 20
    canvas = ids[:8]
    windowed = model(canvas, torch.arange(20, 28), CanvasAttention(cache, 20), decoder=True)

    class Unwindowed(CanvasAttention):
        def attend(self, layer_idx, q, k, v, window, scale):
            return super().attend(layer_idx, q, k, v, None, scale)

    whole = model(canvas, torch.arange(20, 28), Unwindowed(cache, 20), decoder=True)
    assert _rel(windowed, whole) > 1e-3


def test_window_start_and_capacity():
    assert [window_start(n, 1024) for n in (0, 1000, 1023, 5000)] == [0, 0, 0, 3977]
    assert window_start(5000, None) == 0
    cache = GemmaDenseCache([(2, 8), (1, 16)], 4, torch.float32, torch.device("cpu"))
    assert [tuple(k.shape) for k in cache.k] == [(4, 2, 8), (4, 1, 16)]
    with pytest.raises(ConfigError, match="5 positions > capacity 4"):
        cache.write(1, 3, torch.zeros(2, 1, 16), torch.zeros(2, 1, 16))
    buffer = cache.k[0]
    cache.length = 3
    cache.reserve(2)  # fits: empties, keeps the buffers
    assert cache.length == 0 and cache.k[0] is buffer
    cache.reserve(9)
    assert cache.capacity == 9 and cache.k[1].shape == (9, 1, 16)
