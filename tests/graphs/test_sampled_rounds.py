"""Sampled rounds. With top-k / top-p the runner compiles and captures only the forward
(`round_logits`, into a static logits buffer) and decides eagerly with the seeded generator; at
a temperature alone it draws the Exp(1) noise eagerly and compiles the whole round on it
(`NoiseSampling`). Either way the tokens are those of the eager round with the same seed."""

import pytest
import torch

from dlmc.graphs.round import fill_kv
from dlmc.graphs.runner import RoundRunner
from dlmc.kv.dense_cache import DenseKVCache

BL = 16
SAMPLING_ARGS = (0.7, 20, 0.95)  # temperature, top_k, top_p
TEMPERATURE_ONLY = (0.7, None, None)


def _sampled_rounds(llm, mode, algorithm, seed, device="cpu", dtype=torch.float32,
                    args=SAMPLING_ARGS):
    """A prompt block's K/V (written eagerly), then sampled rounds of block 1 until done, and
    block 2's rounds, the first fused with block 1's refresh. Returns the block tokens after
    every round and the runner."""
    cfg, mask_id = llm.model.config, llm.special_ids.mask_token_id
    cache = DenseKVCache(cfg.num_hidden_layers, 256, cfg.num_key_value_heads, cfg.head_dim,
                         dtype, torch.device(device))
    runner = RoundRunner(llm.model, cache, BL, mask_id, mode)
    buf, key_len = runner.buf, runner.key_len(3 * BL)
    positions = torch.arange(3 * BL, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    sampling = (*args, generator)
    rounds = []
    with torch.inference_mode():
        prompt = torch.arange(60, 60 + BL, device=device)
        fill_kv(llm.model, prompt, positions[:BL], cache, key_len, BL)
        buf.editable.fill_(True)
        buf.threshold.fill_(0.95)
        buf.edit_threshold.fill_(0.5)
        buf.max_post.fill_(1)
        buf.quotas.fill_(3)
        buf.steps.fill_(6)
        for block in (1, 2):
            if block == 2:
                runner.prev_tokens.copy_(buf.tokens)
                runner.prev_positions.copy_(buf.positions)
            buf.tokens.fill_(mask_id)
            buf.positions.copy_(positions[block * BL : (block + 1) * BL])
            for name in ("step", "post", "done"):
                getattr(buf, name).zero_()
            done, n = False, 0
            while not done and n < 20:
                if block == 2 and n == 0:
                    done = runner.step_fused(algorithm, key_len, sampling)
                else:
                    done = runner.step(algorithm, key_len, sampling)
                rounds.append(buf.tokens.tolist())
                n += 1
            assert done, f"block {block} not finished in 20 rounds"
    return rounds, runner


def _fail(*args, **kwargs):
    raise AssertionError("a sampled round ran the whole round eagerly")


@pytest.mark.parametrize("algorithm", ["joint", "threshold"])
def test_compiled_sampled_rounds_give_the_eager_tokens(tiny_llm, algorithm, monkeypatch):
    mask_id = tiny_llm.special_ids.mask_token_id
    eager, eager_runner = _sampled_rounds(tiny_llm, "eager", algorithm, seed=3)
    assert eager_runner.logits is None and not eager_runner._graphs  # eager: nothing changes
    with monkeypatch.context() as patch:
        patch.setattr("dlmc.graphs.runner.denoise_round", _fail)
        patch.setattr("dlmc.graphs.runner.denoise_round_fused", _fail)
        compiled, runner = _sampled_rounds(tiny_llm, "compile", algorithm, seed=3)
    assert compiled == eager
    # Both blocks took more than one round (the first left masks) and end without masks.
    assert len(eager) > 4 and mask_id in eager[0] and mask_id not in eager[-1]
    # Only the forwards were compiled: one logits graph each, no full round.
    assert set(runner._graphs) == {("logits", 256), ("logits_fused", 256)}
    assert runner.logits.shape == (BL, tiny_llm.model.config.vocab_size)
    assert runner.logits.dtype == torch.float32
    # `decide` masked the mask column of the static buffer; the rest are the last logits.
    assert torch.isneginf(runner.logits[:, mask_id]).all()
    assert torch.isfinite(runner.logits[:, :mask_id]).all()
    # The generator decides: another seed samples other tokens.
    other, _ = _sampled_rounds(tiny_llm, "eager", algorithm, seed=4)
    assert other[-1] != eager[-1]


@pytest.mark.parametrize("algorithm", ["joint", "threshold"])
def test_temperature_only_rounds_compile_whole_on_eager_noise(tiny_llm, algorithm, monkeypatch):
    """At a temperature alone the whole round compiles (decision included) on noise drawn
    eagerly: the eager round's tokens, with no logits buffer and no eager round."""
    eager, _ = _sampled_rounds(tiny_llm, "eager", algorithm, seed=3, args=TEMPERATURE_ONLY)
    with monkeypatch.context() as patch:
        patch.setattr("dlmc.graphs.runner.decide", _fail)  # no eager decision
        patch.setattr(torch, "multinomial", _fail)  # the noise, not a draw in the round
        compiled, runner = _sampled_rounds(tiny_llm, "compile", algorithm, seed=3,
                                           args=TEMPERATURE_ONLY)
    assert compiled == eager and len(eager) > 4
    assert set(runner._graphs) == {("sampled", algorithm, 256), ("sampled_fused", algorithm, 256)}
    assert runner.logits is None
    assert float(runner.noise.temperature) == pytest.approx(0.7)
    assert runner.noise.noise.shape == (BL, tiny_llm.model.config.vocab_size)
    assert bool((runner.noise.noise > 0).all())  # Exp(1) draws
    other, _ = _sampled_rounds(tiny_llm, "compile", algorithm, seed=4, args=TEMPERATURE_ONLY)
    assert other[-1] != compiled[-1]


def test_greedy_rounds_keep_the_whole_compiled_round(tiny_llm):
    """Greedy rounds still compile the whole round (decision included) and never allocate the
    sampled rounds' logits buffer."""
    cfg, mask_id = tiny_llm.model.config, tiny_llm.special_ids.mask_token_id
    tokens = {}
    for mode in ("eager", "compile"):
        cache = DenseKVCache(cfg.num_hidden_layers, 256, cfg.num_key_value_heads, cfg.head_dim,
                             torch.float32, torch.device("cpu"))
        runner = RoundRunner(tiny_llm.model, cache, BL, mask_id, mode)
        runner.buf.tokens.fill_(mask_id)
        runner.buf.positions.copy_(torch.arange(BL, 2 * BL))
        runner.buf.editable.fill_(True)
        runner.buf.threshold.fill_(0.0)
        runner.buf.edit_threshold.fill_(0.5)
        with torch.inference_mode():
            runner.step("joint", runner.key_len(2 * BL))
        tokens[mode] = runner.buf.tokens.tolist()
        assert runner.logits is None
    assert set(runner._graphs) == {("round", "joint", 256)}
    assert tokens["compile"] == tokens["eager"] and mask_id not in tokens["eager"]


@pytest.mark.gpu
@pytest.mark.parametrize("args", [SAMPLING_ARGS, TEMPERATURE_ONLY], ids=["filtered", "plain"])
def test_graph_sampled_rounds_give_the_eager_tokens_on_cuda(tiny_dir, monkeypatch, args):
    """On CUDA, fp32: sampled rounds replayed as graphs give the eager tokens. With top-k /
    top-p the forwards are captured (logits graphs, the decision eager); at a temperature
    alone the whole rounds, on noise drawn eagerly."""
    from dlmc import LLM

    llm = LLM(tiny_dir, device="cuda", dtype="fp32", mode="eager")
    eager, _ = _sampled_rounds(llm, "eager", "joint", seed=3, device="cuda", args=args)
    with monkeypatch.context() as patch:
        if args is SAMPLING_ARGS:
            patch.setattr("dlmc.graphs.runner.denoise_round", _fail)
            patch.setattr("dlmc.graphs.runner.denoise_round_fused", _fail)
        else:
            patch.setattr("dlmc.graphs.runner.decide", _fail)
        graph, runner = _sampled_rounds(llm, "graph", "joint", seed=3, device="cuda",
                                        args=args)
    assert graph == eager and len(eager) > 2
    want = ({("logits", 256), ("logits_fused", 256)} if args is SAMPLING_ARGS
            else {("sampled", "joint", 256), ("sampled_fused", "joint", 256)})
    assert set(runner._graphs) == want
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in runner._graphs.values())


@pytest.mark.gpu
@pytest.mark.parametrize("filters", [{"top_k": 20, "top_p": 0.9}, {}], ids=["filtered", "plain"])
def test_sampled_requests_replay_graphs_on_cuda(tiny_dir, filters):
    """bf16 requests on the paged cache (where the decoder samples through the runner): the
    graph-replayed rounds give the compiled rounds' tokens, from logits graphs with top-k /
    top-p, from whole sampled-round graphs at a temperature alone."""
    from dlmc import LLM

    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70,
              "temperature": 0.7, "seed": 5} | filters
    results = {}
    for mode in ("compile", "graph"):
        llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode=mode)
        assert llm._decoder.paged
        results[mode] = llm.generate(**kwargs)
        keys = {key[0] for r in llm._decoder._runners.values() for key in r._graphs}
        assert ("logits" if filters else "sampled") in keys and "round" not in keys
    assert results["graph"].token_ids == results["compile"].token_ids
    assert results["graph"].num_forwards == results["compile"].num_forwards > 1
