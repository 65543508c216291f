import pytest
import torch

from dlmc.engine.block_decoder import BlockDecoder
from dlmc.engine.decode_config import DecodeConfig
from dlmc.engine.events import BlockEvent, RoundEvent
from dlmc.errors import ConfigError

from .scripted import EOS, MASK, ScriptedModel, logits_for


def run(model, prompt, cfg, use_cache=True, refresh="fused"):
    dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.float32,
                       refresh=refresh)
    events = []
    gen = dec.decode(prompt, cfg, use_cache=use_cache, rounds=True)
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return stop.value, events


def joint(**kw):
    return DecodeConfig(
        **{
            "algorithm": "joint",
            "threshold": 0.85,
            "edit_threshold": 0.5,
            "max_refine_steps": 3,
            "block_length": 4,
            "max_new_tokens": 8,
            **kw,
        }
    )


def test_fallback_commits_one_per_round_then_early_exit():
    # Always propose token 1 with p = 0.3: nothing passes, top-1 fallback each round.
    model = ScriptedModel(lambda i, t: logits_for([1] * 4, [0.3, 0.31, 0.32, 0.33]))
    out, events = run(model, [2, 3, 4, 5], joint(max_new_tokens=4))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    # Highest p first: positions 3, 2, 1, 0; then one post-fill round that changes nothing.
    assert [r.committed.index(True) for r in rounds[:4]] == [3, 2, 1, 0]
    assert len(rounds) == 5 and not any(rounds[4].committed) and not any(rounds[4].edited)
    assert out.num_forwards == 5 and out.answer_ids == (1, 1, 1, 1)
    assert model.other_calls == 1  # prefill of the prompt block; converged: no refresh forward


def test_edits_while_masks_remain_and_prompt_never_edited():
    # Block 0 holds 1 prompt token and 3 answer positions.
    script = {
        0: logits_for([6, 1, 0, 0], [0.99, 0.9, 0.2, 0.1]),  # commit pos 1 -> 1
        1: logits_for([6, 2, 0, 0], [0.99, 0.6, 0.2, 0.1]),  # edit pos 1 -> 2, fallback pos 2
    }
    model = ScriptedModel(lambda i, t: script.get(i, logits_for([6, 2, 3, 3], [0.99] * 4)))
    out, events = run(model, [4], joint(max_new_tokens=3))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert rounds[1].edited == (False, True, False, False)
    assert rounds[1].committed == (False, False, True, False) and rounds[1].is_masked[3]
    assert all(r.tokens[0] == 4 for r in rounds)  # prompt untouched at p = 0.99
    assert out.answer_ids == (2, 3, 3)


def test_refine_limit_caps_post_fill_rounds():
    flip = [0]

    def script(i, tokens):
        flip[0] ^= 1
        tok = 1 + flip[0]
        return logits_for([tok] * 4, [0.95] * 4)  # keeps editing every filled position

    model = ScriptedModel(script)
    out, _ = run(model, [7, 7, 7, 7], joint(max_new_tokens=4, max_refine_steps=3))
    assert out.num_forwards == 1 + 3  # one fill round, then 3 refine rounds
    assert model.other_calls == 1  # the prefill; the last block's K/V are never read again


@pytest.mark.parametrize("refresh", ["fused", "separate"])
def test_refresh_of_finished_blocks(refresh):
    # No refine rounds: each block ends with the round that filled it, so the K/V that round
    # cached came from masks and are stale.
    model = ScriptedModel(lambda i, t: logits_for([3] * 4, [0.99] * 4))
    out, events = run(model, [7, 7, 7, 7], joint(max_new_tokens=12, max_refine_steps=0),
                      refresh=refresh)
    assert out.answer_ids == (3,) * 12 and out.num_forwards == 3
    # 3 answer blocks: the first two need a refresh, the last one's K/V are never read again.
    if refresh == "fused":  # carried by the first round of blocks 2 and 3
        assert (model.fused_calls, model.other_calls, out.fused_rounds) == (2, 1, 2)
        assert out.total_forwards == 1 + 3
    else:  # prefill + 2 refresh forwards of their own
        assert (model.fused_calls, model.other_calls, out.fused_rounds) == (0, 3, 0)
        assert out.total_forwards == 3 + 3


def test_unknown_refresh_mode_names_the_option():
    with pytest.raises(ConfigError, match="refresh='later'"):
        BlockDecoder(ScriptedModel(lambda i, t: None), MASK, EOS, 64, torch.device("cpu"),
                     torch.float32, refresh="later")


def test_no_post_fill_round_with_zero_refine_steps():
    model = ScriptedModel(lambda i, t: logits_for([1] * 4, [0.95] * 4))
    out, _ = run(model, [7, 7, 7, 7], joint(max_new_tokens=4, max_refine_steps=0))
    assert out.num_forwards == 1


def test_stops_after_block_holding_first_eos_and_cuts_the_answer():
    def script(i, tokens):
        return logits_for([1, EOS, 1, 1], [0.95] * 4) if i >= 2 else logits_for([3] * 4, [0.95] * 4)

    model = ScriptedModel(script)
    out, events = run(model, [7, 7, 7, 7], joint(max_new_tokens=32))
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    assert [b.block_index for b in blocks] == [1, 2]
    assert out.answer_ids == (3, 3, 3, 3, 1, EOS) and out.finish_reason == "stop"
    assert blocks[-1].answer_ids == (1, EOS)


def test_whole_block_canvas_with_unaligned_prompt_and_truncation():
    seen = []

    def script(i, tokens):
        seen.append(tokens.tolist())
        return logits_for([2] * 4, [0.95] * 4)

    model = ScriptedModel(script)
    out, events = run(model, [5, 5, 5, 5, 5, 6], joint(max_new_tokens=5))
    # Prompt of 6 with bl 4: first decoded block is block 1 = positions 4..7 (two prompt tokens).
    assert seen[0] == [5, 6, MASK, MASK]
    blocks = [e.block_index for e in events if isinstance(e, BlockEvent)]
    assert blocks == [1, 2]  # 6 + 5 = 11 tokens -> 3 blocks (0 is prefilled)
    assert out.answer_ids == (2, 2, 2, 2, 2) and out.finish_reason == "length"


def test_threshold_decoder_quota_per_step():
    model = ScriptedModel(lambda i, t: logits_for([1, 2, 3, 4], [0.5, 0.6, 0.7, 0.96]))
    cfg = DecodeConfig(
        algorithm="threshold",
        threshold=0.95,
        edit_threshold=None,
        steps=2,
        block_length=4,
        max_new_tokens=4,
    )
    out, events = run(model, [7, 7, 7, 7], cfg)
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert [sum(r.committed) for r in rounds] == [2, 2]  # quota 2: top-2 by p, then the rest
    assert rounds[0].committed == (False, False, True, True)
    assert out.answer_ids == (1, 2, 3, 4) and out.num_forwards == 2


def test_cancel_stops_at_the_next_round():
    model = ScriptedModel(lambda i, t: logits_for([1] * 4, [0.3] * 4))
    dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.float32)
    gen = dec.decode([7] * 4, joint(max_new_tokens=64), cancel=lambda: model.calls >= 6)
    events = []
    with pytest.raises(StopIteration) as stop:
        while True:
            events.append(next(gen))
    out = stop.value.value
    assert out.finish_reason == "cancelled" and model.calls == 6
    assert out.answer_ids == (1, 1, 1, 1)  # only the block that finished


@pytest.mark.parametrize(
    "role_cfg",
    [
        dict(algorithm="joint", threshold=0.85, edit_threshold=0.5, max_refine_steps=16),
        dict(algorithm="joint", threshold=0.95, edit_threshold=0.0, max_refine_steps=4),
        dict(algorithm="threshold", threshold=0.9, edit_threshold=None, steps=8),
        dict(
            algorithm="joint", threshold=0.7, edit_threshold=0.5, temperature=0.8, seed=5, top_p=0.9
        ),
    ],
)
def test_cached_decoding_equals_uncached(tiny_llm, role_cfg):
    cfg = DecodeConfig(block_length=16, max_new_tokens=40, **role_cfg)
    prompt = list(range(40, 77))  # 37 tokens: not block aligned, two full prompt blocks cached
    dec = tiny_llm._decoder
    outs = []
    for use_cache in (True, False):
        gen = dec.decode(prompt, cfg, use_cache=use_cache)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                outs.append(stop.value)
                break
    assert outs[0].answer_ids == outs[1].answer_ids
    assert outs[0].num_forwards == outs[1].num_forwards
    assert len(outs[0].answer_ids) > 0


@pytest.mark.parametrize("mode", ["eager", "reference"])
def test_threshold_decoder_uneven_quotas(mode):
    # bl 5 over 4 steps: quotas 2, 1, 1, 1 (all below threshold: the quota decides each step).
    model = ScriptedModel(lambda i, t: logits_for([1, 2, 3, 4, 5][: t.numel()], [0.1] * 5))
    dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.float32, mode=mode)
    cfg = DecodeConfig(algorithm="threshold", threshold=0.95, edit_threshold=None, steps=4,
                       block_length=5, max_new_tokens=5)
    gen = dec.decode([7] * 5, cfg, rounds=True)
    events = []
    with pytest.raises(StopIteration):
        while True:
            events.append(next(gen))
    assert [sum(e.committed) for e in events if isinstance(e, RoundEvent)] == [2, 1, 1, 1]


def _flip_script():
    flip = [0]

    def script(i, tokens):
        flip[0] ^= 1
        return logits_for([1 + flip[0]] * 4, [0.95] * 4)  # edits every filled position

    return script


SCRIPTS = {
    "fallback": lambda: (lambda i, t: logits_for([1] * 4, [0.3, 0.31, 0.32, 0.33])),
    "editing": _flip_script,
    "one_round_blocks": lambda: (lambda i, t: logits_for([3] * 4, [0.99] * 4)),
    "eos": lambda: (lambda i, t: logits_for([1, EOS, 1, 1], [0.95] * 4) if i >= 2
                    else logits_for([3] * 4, [0.95] * 4)),
}


@pytest.mark.parametrize("refresh", ["fused", "separate"])
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_rounds_in_flight_equal_rounds_one_by_one(name, refresh):
    """With a round queued ahead of the host's read (`lookahead`), the same rounds run: the
    same answer, round and forward counts, and model calls (a queued round that finds its
    block done runs nothing)."""
    results = []
    for lookahead in (False, True):
        model = ScriptedModel(SCRIPTS[name]())
        dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.float32,
                           refresh=refresh, lookahead=lookahead)
        gen = dec.decode([7, 7, 7, 7, 7], joint(max_new_tokens=16, max_refine_steps=2))
        with pytest.raises(StopIteration) as stop:
            while True:
                next(gen)
        out = stop.value.value
        results.append((out, model.calls, model.other_calls, model.fused_calls))
    assert results[0] == results[1]
    assert results[0][0].num_forwards > results[0][0].blocks  # blocks of several rounds


def test_rounds_in_flight_stop_when_cancelled():
    model = ScriptedModel(lambda i, t: logits_for([1] * 4, [0.3] * 4))
    dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.float32,
                       lookahead=True)
    gen = dec.decode([7] * 4, joint(max_new_tokens=64), cancel=lambda: model.calls >= 7)
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    out = stop.value.value
    # Block 1 took 5 rounds; block 2's first two ran, the cancel was seen before a third.
    assert out.finish_reason == "cancelled" and model.calls == 7
    assert out.answer_ids == (1, 1, 1, 1) and out.num_forwards == 7


def test_lookahead_must_be_a_bool():
    with pytest.raises(ConfigError, match="lookahead='yes'"):
        BlockDecoder(ScriptedModel(lambda i, t: None), MASK, EOS, 64, torch.device("cpu"),
                     torch.float32, lookahead="yes")


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_sampled_rounds_in_flight_draw_what_rounds_one_by_one_draw(top_p):
    """Sampled static rounds (the paged cache) in flight launch the same rounds in the same
    order, so a seeded decode draws the same numbers: the same answer and counts."""
    results = []
    for lookahead in (False, True):
        model = ScriptedModel(lambda i, t: logits_for([1, 2, 3, 4], [0.6, 0.5, 0.4, 0.7]))
        dec = BlockDecoder(model, MASK, EOS, 4096, torch.device("cpu"), torch.bfloat16,
                           kv_layout="paged", lookahead=lookahead)
        cfg = joint(max_new_tokens=16, temperature=0.9, seed=3, top_p=top_p)
        gen = dec.decode([7, 7, 7, 7, 7], cfg)
        with pytest.raises(StopIteration) as stop:
            while True:
                next(gen)
        results.append((stop.value.value, model.calls, model.fused_calls))
    assert results[0] == results[1]
    assert len(set(results[0][0].answer_ids)) > 1  # sampled: not one token everywhere


def _finish(gen):
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    return stop.value.value


@pytest.mark.parametrize("lookahead", [True, False])
def test_cached_decoding_equals_uncached_across_key_length_buckets(tiny_llm, lookahead):
    """The dense cache is attended up to a power-of-two key-length bucket (256, 512, ...): a
    230-token prompt and 64 new tokens decode blocks 7-9 (bl 32), block 8 the first past 256
    keys, so rounds run in the buckets 256 and 512. Cached decoding must still equal uncached
    decoding token for token, with the same forwards (rounds in flight, and one by one)."""
    dec = BlockDecoder(tiny_llm.model, tiny_llm.special_ids.mask_token_id,
                       tiny_llm.special_ids.eos_token_id, 1024, torch.device("cpu"),
                       torch.float32, kv_layout="dense", lookahead=lookahead)
    runner = dec.runner(32)
    assert (runner.key_len(256), runner.key_len(288)) == (256, 512)
    cfg = DecodeConfig(algorithm="joint", threshold=0.85, edit_threshold=0.5,
                       max_refine_steps=4, block_length=32, max_new_tokens=64)
    prompt = [40 + (7 * i) % 200 for i in range(230)]
    cached = _finish(dec.decode(prompt, cfg))
    uncached = _finish(dec.decode(prompt, cfg, use_cache=False))
    assert cached.blocks == uncached.blocks == 3  # 230 + 64 tokens: blocks 7, 8, 9
    assert cached.answer_ids == uncached.answer_ids and len(cached.answer_ids) == 64
    assert cached.num_forwards == uncached.num_forwards
