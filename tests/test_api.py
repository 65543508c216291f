import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmc.errors import ConfigError
from dlmc.results import BlockChunk, Done, RoundEvent


def test_generate_result_fields(tiny_llm):
    res = tiny_llm.generate(messages=[{"role": "user", "content": "Hi!"}], max_new_tokens=40)
    assert len(res.token_ids) == 40 and res.finish_reason == "length"
    assert res.num_forwards >= 1 and res.total_forwards > res.num_forwards
    assert res.tokens_per_forward == pytest.approx(40 / res.num_forwards)
    assert res.request_tps == pytest.approx(40 / res.elapsed_s)
    assert res.text == tiny_llm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    assert res.settings["threshold"] == 0.85 and res.settings["self_conditioning_active"] is False
    assert res.prompt_token_ids[-1] == tiny_llm.tokenizer.convert_tokens_to_ids("</role>")


def test_stream_yields_blocks_rounds_and_the_same_result(tiny_llm):
    kwargs = dict(prompt_token_ids=list(range(65, 90)), max_new_tokens=50)
    events = list(tiny_llm.stream(**kwargs, rounds=True))
    chunks = [e for e in events if isinstance(e, BlockChunk)]
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    done = events[-1]
    assert isinstance(done, Done) and len(rounds) == done.result.num_forwards
    assert [c.block_index for c in chunks] == [0, 1, 2]
    assert sum((list(c.token_ids) for c in chunks), []) == done.result.token_ids
    assert "".join(c.text for c in chunks) == done.result.text
    assert tiny_llm.generate(**kwargs).token_ids == done.result.token_ids


def test_eos_id_and_settings_come_from_the_checkpoint(tiny_llm):
    assert (tiny_llm.special_ids.mask_token_id, tiny_llm.special_ids.eos_token_id) == (257, 256)
    res = tiny_llm.generate(prompt="x", max_new_tokens=8, threshold=0.99, edit_threshold=None)
    assert res.settings["threshold"] == 0.99 and res.settings["edit_threshold"] is None


def test_bad_requests_are_named(tiny_llm):
    with pytest.raises(ConfigError, match="exactly one of"):
        tiny_llm.generate(prompt="a", prompt_token_ids=[1])
    with pytest.raises(ConfigError, match="prompt_token_ids: id 99999"):
        tiny_llm.generate(prompt_token_ids=[1, 99999])
    with pytest.raises(ConfigError, match="messages"):
        tiny_llm.generate(messages=[])
    with pytest.raises(ConfigError, match="exceeds the model's context of 4096"):
        tiny_llm.generate(prompt_token_ids=[1, 2], max_new_tokens=5000)
    with pytest.raises(ConfigError, match="`max_new_tokens`"):
        tiny_llm.generate(prompt="a", max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"prompt_token_ids: token ids are integers, got 1\.7"):
        tiny_llm.generate(prompt_token_ids=[1, 1.7])
    with pytest.raises(ConfigError, match="prompt: expected a string, got int"):
        tiny_llm.generate(5)
    with pytest.raises(ConfigError, match="a non-empty list of strings"):
        tiny_llm.generate(["a", 1])


def test_logits_name_bad_token_ids(tiny_llm):
    with pytest.raises(ConfigError, match="token_ids: expected at least one token id"):
        tiny_llm.logits([])
    with pytest.raises(ConfigError, match="token_ids: id 99999 is outside the vocabulary"):
        tiny_llm.logits([1, 99999])
    with pytest.raises(ConfigError, match="token_ids: 4097 tokens exceed the model's context "
                       "of 4096"):
        tiny_llm.logits([1] * 4097)


def test_max_context_is_checked_against_the_model(tiny_dir):
    from dlmc import LLM

    with pytest.raises(ConfigError, match=r"max_context=5000: .* max_position_embeddings \(4096\)"):
        LLM(tiny_dir, device="cpu", dtype="fp32", max_context=5000)


def test_logits_take_a_list_a_tensor_or_an_array_alike(tiny_llm):
    want = tiny_llm.logits([70, 71, 72])
    assert want.shape == (3, tiny_llm.config.vocab_size)
    assert torch.equal(tiny_llm.logits(torch.tensor([70, 71, 72])), want)
    assert torch.equal(tiny_llm.logits(range(70, 73)), want)


def test_a_list_of_prompts_gives_a_list_of_results(tiny_llm):
    kwargs = dict(max_new_tokens=8, seed=3)
    results = tiny_llm.generate(["1+1=", "Name a colour."], **kwargs)
    assert [r.text for r in results] == [tiny_llm.generate(p, **kwargs).text
                                         for p in ("1+1=", "Name a colour.")]
    assert results[0].prompt_token_ids != results[1].prompt_token_ids


def test_checkpoint_without_tokenizer_works_from_ids(tmp_path):
    from dlmc import LLM
    from dlmc.errors import DlmcError
    from dlmc.loading.tiny import write_tiny_checkpoint

    llm = LLM(write_tiny_checkpoint(tmp_path / "m", seed=2, tokenizer=False), device="cpu")
    res = llm.generate(prompt_token_ids=[10, 11, 12], max_new_tokens=8)
    assert len(res.token_ids) == 8 and res.text == ""
    with pytest.raises(DlmcError, match="no usable tokenizer.*prompt_token_ids"):
        llm.generate(prompt="hello")


@pytest.fixture(scope="module")
def llm_96(tiny_dir):
    from dlmc import LLM

    return LLM(tiny_dir, device="cpu", dtype="fp32", max_context=96)


@pytest.mark.parametrize("prompt_len", [40, 64])
def test_a_request_that_exactly_fits_the_context_runs_and_one_token_more_is_refused(
        llm_96, prompt_len):
    """Context 96 = 3 blocks of 32: prompt + max_new_tokens = 96 fills it exactly (the canvas
    ends on the last slot) and decodes; 97 needs a fourth block and is refused."""
    ids = [65 + i % 50 for i in range(prompt_len)]
    fits = 96 - prompt_len
    res = llm_96.generate(prompt_token_ids=ids, max_new_tokens=fits, edit_threshold=None,
                          threshold=0.0)
    assert res.finish_reason in ("length", "stop") and res.num_forwards >= 1
    assert len(res.token_ids) == fits or res.token_ids[-1] == llm_96.special_ids.eos_token_id
    with pytest.raises(ConfigError, match=rf"{prompt_len} tokens\) \+ max_new_tokens "
                       rf"\({fits + 1}\) rounded up .* = 128 tokens exceeds the model's "
                       "context of 96"):
        llm_96.generate(prompt_token_ids=ids, max_new_tokens=fits + 1)


def test_an_unknown_keyword_is_named_with_generate(tiny_llm):
    with pytest.raises(TypeError, match=r"LLM.generate\(\) got an unexpected keyword argument "
                       r"'max_tokens'; expected some of messages, prompt_token_ids, "
                       "max_new_tokens"):
        tiny_llm.generate("hi", max_tokens=8)
    with pytest.raises(TypeError, match=r"LLM.stream\(\) got an unexpected keyword argument "
                       "'max_tokens'"):
        next(tiny_llm.stream("hi", max_tokens=8))


def test_settings_left_out_take_the_checkpoint_file_under_any_role(tiny_dir, tmp_path):
    """role defaults < paper_decoding.json < explicit arguments, the temperature included
    (left out, it is the file's; given, it is the argument)."""
    import json
    import shutil

    from dlmc import LLM

    shutil.copytree(tiny_dir, tmp_path / "m")
    (tmp_path / "m" / "paper_decoding.json").write_text(json.dumps(
        {"temperature": 0.5, "max_new_tokens": 8, "block_length": 8, "threshold": 0.7}))
    llm = LLM(tmp_path / "m", role="llada2.1", device="cpu", dtype="fp32")
    res = llm.generate(prompt_token_ids=[70, 71, 72], seed=1)
    got = res.settings
    assert (got["temperature"], got["max_new_tokens"], got["block_length"]) == (0.5, 8, 8)
    assert (got["threshold"], got["edit_threshold"]) == (0.7, 0.9)  # the file's, the role's
    res = llm.generate(prompt_token_ids=[70, 71, 72], temperature=0.0, threshold=0.95)
    assert (res.settings["temperature"], res.settings["threshold"]) == (0.0, 0.95)
    assert llm.decode_settings() == llm.decode_settings(temperature=0.5)


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("temperature", float("inf"), "a number in [0, 100]"),
    ("temperature", 1e300, "a number in [0, 100]"),
    ("temperature", True, "a number in [0, 100]"),
    ("temperature", "hot", "a number in [0, 100]"),
    ("threshold", True, "a number in [0, 1]"),
    ("seed", 2**70, "an integer in [0, 2**63 - 1]"),
    ("seed", 1.5, "an integer in [0, 2**63 - 1]"),
    ("seed", -5, "an integer in [0, 2**63 - 1]"),
])
def test_decoding_options_out_of_range_are_refused_by_name(tiny_llm, option, value, expected):
    """Values that a sampler would turn into NaN probabilities or a generator would refuse."""
    with pytest.raises(ConfigError, match=re.escape(f"`{option}`: expected {expected}")):
        tiny_llm.generate(prompt_token_ids=[65, 66], max_new_tokens=4,
                          **{"temperature": 0.5, option: value})


@pytest.mark.parametrize("temperature", [1e-302, 1e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny_llm, temperature):
    """Logits / 1e-302 overflow: below 1e-5 (vLLM's epsilon) the decode is greedy, and the
    settings say so."""
    kwargs = dict(prompt_token_ids=list(range(65, 90)), max_new_tokens=32)
    greedy = tiny_llm.generate(**kwargs)
    tiny = tiny_llm.generate(**kwargs, temperature=temperature, seed=3)
    assert tiny.token_ids == greedy.token_ids and tiny.settings["temperature"] == 0.0
    assert tiny_llm.generate(**kwargs, temperature=1e-5, seed=3).settings["temperature"] == 1e-5


def test_a_stop_sequence_ends_the_answer_before_it(tiny_llm):
    kwargs = dict(prompt_token_ids=list(range(65, 90)), max_new_tokens=96)
    full = tiny_llm.generate(**kwargs)
    stop = full.text[40:43]  # in the second of three blocks of 32
    at = full.text.find(stop)
    events = list(tiny_llm.stream(**kwargs, stop=[stop, "never in it \x00"]))
    chunks, res = [e for e in events if isinstance(e, BlockChunk)], events[-1].result
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == full.text[:at] == "".join(c.text for c in chunks)
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert sum((list(c.token_ids) for c in chunks), []) == res.token_ids
    assert stop in tiny_llm.decode_text(res.token_ids)  # the last id completes it
    assert stop not in tiny_llm.decode_text(res.token_ids[:-1])
    assert res.blocks == len(chunks) < full.blocks and res.num_forwards < full.num_forwards
    assert res.settings["stop"] == [stop, "never in it \x00"]
    assert tiny_llm.generate(**kwargs, stop="\x00\x01").text == full.text  # none appears
    with pytest.raises(ConfigError, match="stop: a stop sequence must not be empty"):
        tiny_llm.generate(**kwargs, stop=[""])


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2**70),
                    st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(options=st.fixed_dictionaries({}, optional={
    "temperature": NUMBERS, "top_k": NUMBERS, "top_p": NUMBERS, "threshold": NUMBERS,
    "edit_threshold": NUMBERS, "seed": NUMBERS, "block_length": st.one_of(
        st.integers(-1, 40), NUMBERS),
    # small: the random tiny model's edits need not converge, so refine steps all run
    "max_refine_steps": st.one_of(st.integers(-1, 3), st.sampled_from([2.5, True, None]))}))
def test_any_decoding_options_decode_or_are_refused_by_name(tiny_llm, options):
    """Whatever the values, `generate` decodes, or raises ConfigError naming the option."""
    try:
        res = tiny_llm.generate(prompt_token_ids=[65, 66, 67], max_new_tokens=4, **options)
    except ConfigError as exc:
        assert any(f"`{name}`" in str(exc) for name in options), str(exc)
        return
    assert len(res.token_ids) <= 4 + res.settings["block_length"] and res.token_ids
