"""dlmc's DiffusionGemma against transformers' implementation (the reference) on tiny random
models: encoder (causal) logits, decoder (canvas) logits over the encoder's cache with and
without self-conditioning, the router and the experts."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf  # noqa: E402

from dlmc.custom_ops.kernel_config import KernelConfig  # noqa: E402
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion  # noqa: E402
from dlmc.models.diffusion_gemma_attention import (  # noqa: E402
    CanvasContext,
    CausalContext,
    GemmaKVCache,
)
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig  # noqa: E402
from dlmc.models.diffusion_gemma_moe import GemmaExperts, GemmaRouter  # noqa: E402
from dlmc.models.nvfp4_experts import apply_kernel_config  # noqa: E402

VOCAB, CANVAS, PROMPT = 128, 8, 13
TINY_TEXT = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "num_experts": 8, "top_k_experts": 2,
    "moe_intermediate_size": 24, "sliding_window": 5, "max_position_embeddings": 256,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
}
TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 8, "global_head_dim": 8}
# Tensors transformers initialises to ones (norm weights, scales): random in [0.75, 1.25) here.
ONE_CENTRED = ("norm.weight", "layernorm.weight", "layernorm_1.weight", "layernorm_2.weight",
               "router.scale", "per_expert_scale", "layer_scalar")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _softcap(logits: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    return torch.tanh(logits.float() / cap) * cap


def hf_model(seed: int, **text_overrides) -> hf.DiffusionGemmaForBlockDiffusion:
    """transformers' model with seeded random weights (encoder and decoder tied, as loaded)."""
    config = transformers.DiffusionGemmaConfig(
        text_config={**TINY_TEXT, **text_overrides}, vision_config=TINY_VISION,
        canvas_length=CANVAS)
    config._attn_implementation = "eager"
    model = hf.DiffusionGemmaForBlockDiffusion(config).eval()
    gen = torch.Generator().manual_seed(seed)
    tensors = [*model.model.decoder.named_parameters(), *model.model.decoder.named_buffers()]
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(ONE_CENTRED):
                tensor.copy_(0.75 + 0.5 * torch.rand(tensor.shape, generator=gen))
            elif "rotary_emb" not in name and not name.endswith("embed_scale"):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
        encoder_layers = model.model.encoder.language_model.layers
        for enc, dec in zip(encoder_layers, model.model.decoder.layers, strict=True):
            enc.layer_scalar.copy_(dec.layer_scalar)  # a buffer: not tied by transformers
    return model


def dlmc_model(reference: hf.DiffusionGemmaForBlockDiffusion) -> DiffusionGemmaForBlockDiffusion:
    """dlmc's model from the reference's saved config, filled by checkpoint name (strict)."""
    config = DiffusionGemmaConfig.from_dict(reference.config.to_dict())
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    state = {k: v for k, v in reference.state_dict().items() if k.startswith("model.decoder.")}
    model.load_state_dict(state, strict=True)
    return model


def hf_encode(reference, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """The encoder pass: hidden states of `ids` appended to `cache`, then the (tied) lm_head."""
    out = reference.model.encoder(input_ids=ids[None], cache=cache)
    return _softcap(reference.lm_head(out.last_hidden_state))[0]


def hf_decode(reference, canvas: torch.Tensor, cache: DynamicCache,
              sc_logits: torch.Tensor | None) -> torch.Tensor:
    """The decoder pass, as generation calls it: the canvas over the read-only cache."""
    sc = None if sc_logits is None else sc_logits[None]
    return reference(decoder_input_ids=canvas[None], cache=cache,
                     self_conditioning_logits=sc).logits[0]


class _UnwindowedCanvas(CanvasContext):
    """The decoder context without the sliding window (to show the window matters)."""

    def attend(self, layer_idx, q, k, v, window, scale):
        return super().attend(layer_idx, q, k, v, None, scale)


@pytest.mark.parametrize(("seed", "window"), [(0, 5), (1, 3), (2, 7), (3, 4)])
@torch.no_grad()
def test_encoder_and_decoder_logits_match_transformers(seed, window):
    reference = hf_model(seed, sliding_window=window)
    model = dlmc_model(reference)
    gen = torch.Generator().manual_seed(100 + seed)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    canvases = torch.randint(0, VOCAB, (2, CANVAS), generator=gen)
    hf_cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
    cache = GemmaKVCache(model.config.num_hidden_layers)
    assert window < PROMPT  # the sliding windows cut the cache

    start, errors = 0, []
    for block, tokens in enumerate([prompt, *canvases]):
        positions = torch.arange(start, start + tokens.shape[0])
        want = hf_encode(reference, tokens, hf_cache)
        got = model(tokens, positions, CausalContext(cache))
        assert got.shape == want.shape and got.dtype == torch.float32
        errors.append(_rel(got, want))
        start += tokens.shape[0]
        assert cache.length(0) == hf_cache.get_seq_length() == start
        if block == 2:
            break
        # Decoder passes over the next canvas: the first step without self-conditioning, the
        # second with the first step's tempered logits.
        canvas_pos = torch.arange(start, start + CANVAS)
        sc = None
        for _step in range(2):
            want = hf_decode(reference, canvases[block], hf_cache, sc)
            got = model(canvases[block], canvas_pos, CanvasContext(cache), decoder=True,
                        self_conditioning_logits=sc)
            errors.append(_rel(got, want))
            if sc is None:
                first = want
            else:
                assert _rel(want, first) > 1e-2  # self-conditioning changes the logits
            sc = want / 0.8
        assert cache.length(0) == hf_cache.get_seq_length() == start  # read-only
        unwindowed = model(canvases[block], canvas_pos, _UnwindowedCanvas(cache), decoder=True)
        assert _rel(unwindowed, first) > 1e-3
    assert max(errors) < 1e-5, errors


@torch.no_grad()
def test_bf16_logits_equal_transformers_loaded_in_bf16(tmp_path):
    """transformers' model saved and loaded with `dtype=bfloat16` (its RoPE inverse frequencies
    stay fp32) against dlmc's in bf16 (the bf16 `torch._grouped_mm` experts): the same ops in
    the same order, so the logits are bitwise equal; `soft_cap=False` gives the bf16 values
    before the cap."""
    reference32 = hf_model(4)
    model = dlmc_model(reference32).to(torch.bfloat16)
    reference32.save_pretrained(tmp_path)
    reference = hf.DiffusionGemmaForBlockDiffusion.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    hf_cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
    cache = GemmaKVCache(model.config.num_hidden_layers)
    want = hf_encode(reference, prompt, hf_cache)
    assert torch.equal(model(prompt, torch.arange(PROMPT), CausalContext(cache)), want)
    canvas_pos = torch.arange(PROMPT, PROMPT + CANVAS)
    sc = None
    for _step in range(2):
        want = hf_decode(reference, canvas, hf_cache, sc)
        got = model(canvas, canvas_pos, CanvasContext(cache), decoder=True,
                    self_conditioning_logits=sc)
        assert torch.equal(got, want)
        raw = model(canvas, canvas_pos, CanvasContext(cache), decoder=True,
                    self_conditioning_logits=sc, soft_cap=False)  # before the cap
        cap = model.config.final_logit_softcapping
        assert raw.dtype == torch.bfloat16 and not torch.equal(raw.float(), got)
        assert torch.equal(torch.tanh(raw.float() / cap) * cap, got)
        sc = (want / 0.8).bfloat16()


@torch.no_grad()
def test_whole_sequence_causal_pass_equals_chunked_encoding():
    """Encoding a sequence at once or in chunks through the cache gives the same logits."""
    model = dlmc_model(hf_model(5))
    ids = torch.randint(0, VOCAB, (PROMPT + CANVAS,), generator=torch.Generator().manual_seed(5))
    whole = model(ids, torch.arange(ids.shape[0]), CausalContext())
    cache = GemmaKVCache(model.config.num_hidden_layers)
    head = model(ids[:PROMPT], torch.arange(PROMPT), CausalContext(cache))
    tail = model(ids[PROMPT:], torch.arange(PROMPT, ids.shape[0]), CausalContext(cache),
                 logits_from=2)
    torch.testing.assert_close(torch.cat([head, tail]), torch.cat([whole[:PROMPT],
                               whole[PROMPT + 2:]]), rtol=1e-5, atol=1e-5)
    assert model(ids, torch.arange(ids.shape[0]), CausalContext(), compute_logits=False) is None


def test_self_conditioning_logits_need_the_decoder_pass():
    model = dlmc_model(hf_model(0))
    ids = torch.zeros(CANVAS, dtype=torch.long)
    with pytest.raises(ValueError, match="decoder pass only"):
        model(ids, torch.arange(CANVAS), CausalContext(),
              self_conditioning_logits=torch.zeros(CANVAS, VOCAB))


def test_parameter_names_are_the_checkpoint_names():
    model = dlmc_model(hf_model(0))
    names = set(model.state_dict())
    assert "model.decoder.layers.2.self_attn.v_proj.weight" not in names  # full layer: K = V
    assert {"model.decoder.layers.0.self_attn.v_proj.weight",
            "model.decoder.layers.5.experts.gate_up_proj",
            "model.decoder.layers.5.router.per_expert_scale",
            "model.decoder.layers.5.layer_scalar",
            "model.decoder.self_conditioning.pre_norm.weight"} <= names
    assert not any("post_norm" in n or "v_norm" in n or "lm_head" in n for n in names)
    assert model.state_dict()["model.decoder.layers.2.self_attn.q_proj.weight"].shape == (
        4 * 32, 64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_router_and_experts_match_transformers(seed):
    whole = hf_model(seed)
    reference = whole.model.decoder.layers[1]
    config = DiffusionGemmaConfig.from_dict(whole.config.to_dict())
    router = GemmaRouter(config)
    router.load_state_dict(reference.router.state_dict())
    experts = GemmaExperts(8, 64, 24)
    experts.load_state_dict(reference.experts.state_dict())
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(seed))
    _, want_w, want_ids = reference.router(x)
    ids, weights = router(x)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    # Repeated and unused experts: every token routes to experts 0..2 only.
    ids = torch.randint(0, 3, (11, 2), generator=torch.Generator().manual_seed(seed))
    want = reference.experts(x, ids, weights)
    got = experts(x, ids, weights)
    assert _rel(got, want) < 1e-5


def test_bf16_grouped_experts_match_the_fp32_gather_path():
    """The bf16 `torch._grouped_mm` path against the fp32 per-pair path (bf16 rounding)."""
    gen = torch.Generator().manual_seed(7)
    experts = GemmaExperts(8, 64, 32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.2 * torch.randn(8, 64, 64, generator=gen))
        experts.down_proj.copy_(0.2 * torch.randn(8, 64, 32, generator=gen))
    x = torch.randn(13, 64, generator=gen)
    ids = torch.randint(0, 5, (13, 2), generator=gen)  # experts 5..7 get no token
    weights = torch.rand(13, 2, generator=gen)
    want = experts(x, ids, weights)
    got = experts.to(torch.bfloat16)(x.bfloat16(), ids, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (13, 64)
    assert _rel(got.float(), want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_cuda_rope_tables_equal_the_torch_ops_bit_for_bit(kind):
    """On CUDA in bf16 the tables come from `dlmc::rope_tables`: the same bits as the torch
    ops (the full layers' proportional RoPE: a quarter of the pairs rotate, the rest cos 1)."""
    from dlmc.custom_ops.rope_tables import cos_sin_tables, rope_tables_reference
    from dlmc.models.diffusion_gemma_config import RopeParameters
    from dlmc.models.diffusion_gemma_layers import rope_inv_freq

    rope, dim = ((RopeParameters("default", 10_000.0), 256) if kind == "sliding" else
                 (RopeParameters("proportional", 1_000_000.0, partial_rotary_factor=0.25), 512))
    positions = torch.arange(1000, 1280, device="cuda")
    inv_freq = rope_inv_freq(rope, dim, positions.device)
    cos, sin = cos_sin_tables(positions, inv_freq, torch.bfloat16)
    want_cos, want_sin = rope_tables_reference(positions, inv_freq, torch.bfloat16)
    assert cos.shape == (280, dim) and cos.dtype == torch.bfloat16
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert not torch.equal(sin, torch.zeros_like(sin))


@torch.no_grad()
def test_fused_projections_compute_what_the_separate_ones_do():
    """`KernelConfig(gemma_fused_projections=True)` at load: q/k/v (full layers: q/k) and each
    dense MLP's gate/up become one weight, the checkpoint's weights views into it (names and
    values kept, memory not doubled); the encoder and decoder logits stay the separate
    projections' (fp32, CPU); applying it twice changes nothing."""
    model = dlmc_model(hf_model(6))
    names = set(model.state_dict())
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=gen)
    sc = torch.randn(CANVAS, VOCAB, generator=gen)

    def passes() -> list[torch.Tensor]:
        cache = GemmaKVCache(model.config.num_hidden_layers)
        encoded = model(prompt, torch.arange(PROMPT), CausalContext(cache))
        return [encoded, model(canvas, torch.arange(PROMPT, PROMPT + CANVAS),
                               CanvasContext(cache), decoder=True, self_conditioning_logits=sc)]

    want = passes()
    layers = model.model.decoder.layers
    assert layers[0].self_attn.qkv_weight is None and layers[0].mlp.gate_up_weight is None
    for _ in range(2):
        apply_kernel_config(model, KernelConfig(gemma_fused_projections=True))
    sliding, full, mlp = layers[0].self_attn, layers[2].self_attn, layers[0].mlp
    assert sliding.qkv_weight.shape == (4 * 16 + 2 * 2 * 16, 64)  # q, k, v
    assert full.qkv_weight.shape == (4 * 32 + 32, 64)  # q, k (V = K)
    assert mlp.gate_up_weight.shape == (2 * 96, 64)
    for fused, parts in ((sliding.qkv_weight, (sliding.q_proj, sliding.k_proj, sliding.v_proj)),
                         (mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))):
        rows = torch.cat([p.weight for p in parts])
        assert torch.equal(rows, fused)
        assert all(p.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                   for p in parts)
    assert set(model.state_dict()) == names
    for got, expected in zip(passes(), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
