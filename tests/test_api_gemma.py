"""`dlmc.LLM` with a DiffusionGemma checkpoint: the canvas decoder behind the same interface
(generate, stream with canvas round events, logits, settings), text-only requests with exactly
one <bos>, and LLaDA2's options refused by name."""

import json

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlmc.errors import ConfigError
from dlmc.loading.tiny_gemma_tokenizer import BOS_ID, IMAGE_ID, TURN_OPEN_ID
from dlmc.results import BlockChunk, CanvasRoundEvent, Done

CHAT = [{"role": "user", "content": "Hi"}]
FAST = {"max_denoising_steps": 6}  # the released 48 steps are slow on a shared CPU


def test_generate_result_and_settings(tiny_gemma_llm):
    llm = tiny_gemma_llm
    res = llm.generate(messages=CHAT, seed=0, **FAST)
    assert llm.mode == "eager" and llm.special_ids.mask_token_id is None
    assert res.prompt_token_ids[:2] == [BOS_ID, TURN_OPEN_ID]
    assert res.prompt_token_ids.count(BOS_ID) == 1
    prompt = llm.tokenizer.decode(res.prompt_token_ids)
    assert prompt == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    eos = set(res.settings["eos_token_ids"])
    assert (res.finish_reason == "stop") == bool(eos & set(res.token_ids))
    if res.finish_reason == "stop":
        assert res.token_ids[-1] in eos and not eos & set(res.token_ids[:-1])
    counted = sum(t != 0 for t in res.token_ids)
    assert res.tokens_per_forward == pytest.approx(counted / res.num_forwards)
    assert res.num_forwards <= 6 * res.blocks
    assert res.total_forwards == res.num_forwards + res.blocks  # the prompt, all but the last
    assert res.text == llm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    s = res.settings
    assert (s["max_denoising_steps"], s["t_max"], s["entropy_bound"], s["seed"]) == (6, 0.8, 0.1, 0)
    assert s["sources"]["max_denoising_steps"] == "argument"
    assert s["sources"]["t_max"] == "generation_config.json"
    assert s["model_type"] == "diffusion_gemma" and s["mode"] == "eager" and s["role"] == "orl"


def test_a_stability_threshold_past_the_step_budget_is_never_met(tiny_gemma_llm):
    """Past `max_denoising_steps` a threshold cannot be met, whatever its size: every canvas
    takes all its steps, and a huge one decodes as one just past the budget (its history is
    kept at the budget's depth, not allocated at the threshold's)."""
    kwargs = dict(messages=CHAT, seed=0, max_new_tokens=64, max_denoising_steps=3,
                  confidence_threshold=1e9)  # confident at once: only stability can stop
    just_past = tiny_gemma_llm.generate(**kwargs, stability_threshold=4)
    huge = tiny_gemma_llm.generate(**kwargs, stability_threshold=2**31 - 1)
    assert huge.token_ids == just_past.token_ids
    assert huge.num_forwards == just_past.num_forwards == 3 * huge.blocks
    stops = tiny_gemma_llm.generate(**kwargs, stability_threshold=0)
    assert stops.num_forwards == stops.blocks  # the same settings can stop at once


def test_stream_yields_canvas_rounds_chunks_and_the_same_result(tiny_gemma_llm):
    kwargs = dict(prompt_token_ids=[BOS_ID, 300, 301, 302], max_new_tokens=96, seed=3,
                  max_denoising_steps=5)
    events = list(tiny_gemma_llm.stream(**kwargs, rounds=True))
    rounds = [e for e in events if isinstance(e, CanvasRoundEvent)]
    chunks = [e for e in events if isinstance(e, BlockChunk)]
    done = events[-1]
    assert isinstance(done, Done) and len(rounds) == done.result.num_forwards
    assert [c.block_index for c in chunks] == list(range(done.result.blocks))
    assert sum((list(c.token_ids) for c in chunks), []) == done.result.token_ids
    assert "".join(c.text for c in chunks) == done.result.text
    for event in rounds:
        assert len(event.tokens) == len(event.accepted) == len(event.argmax) == 32
        assert 1 <= sum(event.accepted) <= 32 and event.mean_entropy >= 0
    assert any(not all(e.accepted) for e in rounds)  # some positions re-noised
    assert [e.round_index for e in rounds if e.canvas_index == 0][:3] == [1, 2, 3]
    assert rounds[0].steps_remaining == 5
    again = tiny_gemma_llm.generate(**kwargs)
    assert again.token_ids == done.result.token_ids  # the seed fixes every draw
    other = tiny_gemma_llm.generate(**{**kwargs, "seed": 4})
    assert other.token_ids != done.result.token_ids


def test_prompts_get_exactly_one_bos(tiny_gemma_llm):
    llm = tiny_gemma_llm
    raw = llm.encode_prompt(prompt="Hi")
    assert raw[0] == BOS_ID and raw.count(BOS_ID) == 1
    assert llm.encode_prompt(prompt="<bos>Hi") == raw
    assert llm.encode_prompt(prompt_token_ids=[300, 301]) == [300, 301]  # ids as given


def test_images_are_refused_by_name(tiny_gemma_llm):
    llm = tiny_gemma_llm
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
    with pytest.raises(ConfigError, match=r"messages\[0\].content\[1\]: a 'image_url' part; "
                                          r"dlmc runs DiffusionGemma's text path only"):
        llm.generate(messages=[{"role": "user", "content": parts}])
    with pytest.raises(ConfigError, match=r"messages\[0\].images: .*vision tower"):
        llm.generate(messages=[{"role": "user", "content": "Hi", "images": ["cat.png"]}])
    with pytest.raises(ConfigError, match=rf"prompt: id {IMAGE_ID} is an image placeholder"):
        llm.generate(prompt_token_ids=[BOS_ID, IMAGE_ID, 300])
    text_parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    assert llm.encode_prompt(messages=[{"role": "user", "content": text_parts}]) == (
        llm.encode_prompt(messages=CHAT))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 0.9}, "`threshold`: a LLaDA2 setting"),
    ({"edit_threshold": None}, "`edit_threshold`: a LLaDA2 setting"),
    ({"temperature": 0.5}, "`temperature`: a LLaDA2 setting"),
    ({"block_length": 32}, "`block_length`: a LLaDA2 setting"),
    ({"t_min": 0.9}, "`t_max`"),
    ({"max_new_tokens": 10**6}, "exceeds the model's context of 8192"),
])
def test_bad_options_are_named(tiny_gemma_llm, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        tiny_gemma_llm.generate(prompt_token_ids=[BOS_ID, 300], **kwargs)


def test_llada2_refuses_the_canvas_options(tiny_llm):
    with pytest.raises(ConfigError, match="decoding option `t_min`: a DiffusionGemma setting; "
                       "LLaDA2's decoder takes max_new_tokens, threshold"):
        tiny_llm.generate(prompt_token_ids=[1, 2], max_new_tokens=4, t_min=0.3)


@torch.no_grad()
def test_logits_are_the_encoders_causal_logits(tiny_gemma_llm):
    from dlmc.models.diffusion_gemma_attention import CausalContext

    llm = tiny_gemma_llm
    ids = [BOS_ID, 300, 301, 302, 303]
    got = llm.logits(ids)
    assert got.shape == (5, 520) and got.dtype == torch.float32
    want = llm.model(torch.tensor(ids), torch.arange(5), CausalContext())
    assert torch.equal(got, want)
    prefix = llm.logits(ids[:3])  # causal: a row does not see later tokens
    torch.testing.assert_close(prefix, got[:3], rtol=1e-5, atol=1e-5)
    assert got.abs().max() <= 30.0  # soft-capped
    with pytest.raises(ConfigError, match="block_length: a LLaDA2 option"):
        llm.logits(ids, block_length=32)


def test_engine_options_that_do_not_apply_are_refused(tiny_gemma_dir):
    from dlmc import LLM

    with pytest.raises(ConfigError, match=r"mode 'graph' \(CUDA graphs\) needs"):
        LLM(tiny_gemma_dir, device="cpu", mode="graph")
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8': mode 'reference' keeps K/V"):
        LLM(tiny_gemma_dir, device="cpu", kv_cache_dtype="fp8", mode="reference")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8' is not one of auto, bf16, fp8"):
        LLM(tiny_gemma_dir, device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="role 'llada2.0': a diffusion_gemma checkpoint"):
        LLM(tiny_gemma_dir, device="cpu", role="llada2.0")


def test_paper_decoding_and_the_builtin(tmp_path, monkeypatch):
    from dlmc import LLM
    from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint

    path = write_tiny_gemma_checkpoint(tmp_path / "orl", seed=1, shards=1)
    (path / "paper_decoding.json").write_text(json.dumps(
        {"decoding": {"threshold": 0.85, "max_new_tokens": 32, "max_denoising_steps": 3}}))
    res = LLM(path, device="cpu").generate(prompt_token_ids=[BOS_ID, 300], seed=0)
    assert res.blocks == 1 and res.num_forwards <= 3
    assert res.settings["sources"]["max_new_tokens"] == "paper_decoding.json"
    monkeypatch.setenv("DLMC_CACHE", str(tmp_path / "cache"))
    builtin = LLM("tiny-diffusiongemma", device="cpu")
    assert builtin.config.canvas_length == 32 and builtin.model_dir.name.startswith(
        "tiny-diffusiongemma")


def test_fp8_kv_cache(tiny_gemma_dir, tmp_path):
    """kv_cache_dtype "fp8": bf16 activations by default, the static cache in float8_e4m3fn
    with the checkpoint's per-layer scales (1.0 where it has none, as the BF16 tiny model);
    "auto" picks FP8 where an NVFP4 export declares it and activations are bf16."""
    from dlmc import LLM
    from dlmc.loading.tiny_gemma import TINY_NVFP4_KV_SCALE, write_tiny_gemma_nvfp4

    llm = LLM(tiny_gemma_dir, device="cpu", kv_cache_dtype="fp8")
    res = llm.generate(messages=CHAT, seed=0, **FAST)
    assert llm.dtype == torch.bfloat16 and llm.kv_cache_dtype == "fp8"
    assert res.settings["kv_cache_dtype"] == "fp8" and res.num_forwards >= 1
    cache = llm._canvas.decoder.stepper(True).cache
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.k_scales == (1.0,) * 6
    assert int(cache.length) == len(res.prompt_token_ids) + llm.config.canvas_length * (
        res.blocks - 1)
    assert LLM(tiny_gemma_dir, device="cpu", dtype="bf16").kv_cache_dtype == "bfloat16"
    export = write_tiny_gemma_nvfp4(tmp_path / "nvfp4", seed=1, shards=1)
    auto = LLM(export, device="cpu", dtype="bf16")
    assert auto.kv_cache_dtype == "fp8"
    cache = auto._canvas.decoder.stepper(True).cache
    assert cache.k_scales == cache.v_scales == pytest.approx((TINY_NVFP4_KV_SCALE,) * 6)
    assert LLM(export, device="cpu").kv_cache_dtype == "float32"  # fp32 activations
    assert LLM(export, device="cpu", dtype="bf16", kv_cache_dtype="bf16").kv_cache_dtype == (
        "bfloat16")


def test_a_stop_sequence_ends_the_canvases(tiny_gemma_llm):
    kwargs = dict(prompt_token_ids=[BOS_ID, 300, 301, 302], max_new_tokens=96, seed=3,
                  max_denoising_steps=5)
    events = list(tiny_gemma_llm.stream(**kwargs, rounds=True))
    full = events[-1].result
    first = next(e for e in events if isinstance(e, BlockChunk))
    steps = sum(isinstance(e, CanvasRoundEvent) and e.canvas_index == 0 for e in events)
    assert full.blocks == 3 and len(first.text) >= 4
    stop = first.text[len(first.text) // 2 :][:2]
    at = full.text.find(stop)
    res = tiny_gemma_llm.generate(**kwargs, stop=stop)
    assert (res.finish_reason, res.stop_reason, res.text) == ("stop", stop, full.text[:at])
    assert res.token_ids == full.token_ids[: len(res.token_ids)] and len(res.token_ids) <= 32
    assert res.blocks == 1 and res.num_forwards == steps
    assert res.total_forwards == steps + 1  # the prompt; the first canvas is never encoded


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2**70),
                    st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(options=st.fixed_dictionaries({"max_denoising_steps": st.integers(1, 3)}, optional={
    "t_min": NUMBERS, "t_max": NUMBERS, "entropy_bound": NUMBERS, "confidence_threshold": NUMBERS,
    "stability_threshold": NUMBERS, "seed": NUMBERS, "temperature": NUMBERS}))
@example(options={"max_denoising_steps": 1, "entropy_bound": 2**64})  # once overflowed a tensor
def test_any_sampler_options_decode_or_are_refused_by_name(tiny_gemma_llm, options):
    """Whatever the values, `generate` decodes, or raises ConfigError naming the option."""
    try:
        res = tiny_gemma_llm.generate(messages=CHAT, max_new_tokens=8, **options)
    except ConfigError as exc:
        assert any(f"`{name}`" in str(exc) for name in options), str(exc)
        return
    assert res.token_ids and res.num_forwards <= 3 * res.blocks
