"""The round function: eager and compiled give identical tokens; compiled with fullgraph=True
(which fails on any host sync or graph break inside the round)."""

import pytest
import torch

from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.engine.block_decoder import BlockDecoder
from dlmc.engine.decode_config import DecodeConfig
from dlmc.errors import ConfigError
from dlmc.graphs.runner import RoundRunner
from dlmc.kv.paged_cache import KVCacheConfig, PagedKVCache


def _decode(llm, mode, prompt, cfg):
    dec = BlockDecoder(llm.model, llm.special_ids.mask_token_id, llm.special_ids.eos_token_id,
                       1024, torch.device("cpu"), torch.float32, mode=mode)
    gen = dec.decode(prompt, cfg, rounds=True)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return stop.value, events, dec


@pytest.mark.parametrize("algorithm", ["joint", "threshold"])
def test_eager_compiled_and_reference_rounds_agree(tiny_llm, algorithm):
    cfg = DecodeConfig(algorithm=algorithm, threshold=0.8, edit_threshold=0.5,
                       max_refine_steps=4, steps=8, block_length=16, max_new_tokens=40)
    prompt = list(range(60, 97))
    ref, ref_events, _ = _decode(tiny_llm, "reference", prompt, cfg)
    eager, eager_events, _ = _decode(tiny_llm, "eager", prompt, cfg)
    compiled, compiled_events, dec = _decode(tiny_llm, "compile", prompt, cfg)
    assert eager.answer_ids == ref.answer_ids == compiled.answer_ids
    assert eager.num_forwards == ref.num_forwards == compiled.num_forwards
    assert eager_events == compiled_events == ref_events
    assert dec.runner(16).compile_s > 0


def test_graph_mode_needs_cuda(tiny_llm):
    with pytest.raises(ConfigError, match="round mode 'graph' needs a CUDA device"):
        RoundRunner(tiny_llm.model, tiny_llm._decoder.cache, 32, 0, "graph")
    with pytest.raises(ConfigError, match="round mode 'fast'"):
        RoundRunner(tiny_llm.model, tiny_llm._decoder.cache, 32, 0, "fast")


def test_launch_runs_the_round_that_step_runs(tiny_llm):
    """`launch` (what `dlmc bench round` queues back to back) is `step` without the host's read
    of the done flag: the same round, the same block state afterwards."""
    from dataclasses import fields

    runners = [RoundRunner(tiny_llm.model, tiny_llm._decoder.cache, 16, 0, "eager")
               for _ in range(2)]
    for runner in runners:
        runner.buf.tokens.copy_(torch.arange(16) % 3)  # a few masks (id 0) among tokens
        runner.buf.positions.copy_(torch.arange(40, 56))
        runner.buf.editable.fill_(True)
        runner.buf.threshold.fill_(0.0)
        runner.buf.edit_threshold.fill_(0.5)
        runner.buf.max_post.fill_(4)
    key_len = runners[0].key_len(56)
    assert runners[0].step("joint", key_len) in (True, False)
    assert runners[1].launch("joint", key_len) is None
    for f in fields(runners[0].buf):
        assert torch.equal(getattr(runners[0].buf, f.name), getattr(runners[1].buf, f.name)), f
    assert runners[1].buf.step.item() == 1 and not (runners[1].buf.tokens == 0).any()


def test_cache_and_runner_made_in_inference_mode_take_rounds_outside_it(tiny_dir):
    """The decoder's cache and round buffers, made on first use, are normal tensors even when
    that use is inside `torch.inference_mode` (a generate's loop): a round run outside it
    afterwards writes them (CI failed on this when another test had first used the cache)."""
    from dlmc import LLM

    llm = LLM(tiny_dir, device="cpu", mode="eager")
    with torch.inference_mode():
        runner = llm._decoder.runner(16)
    assert not llm._decoder.cache.k[0].is_inference()
    assert not runner.buf.tokens.is_inference()
    runner.buf.tokens.copy_(torch.arange(16) % 3)
    runner.buf.positions.copy_(torch.arange(40, 56))
    runner.buf.editable.fill_(True)
    runner.buf.max_post.fill_(4)
    runner.step("joint", runner.key_len(56))
    assert runner.buf.step.item() == 1


def test_key_length_buckets(tiny_llm):
    runner = RoundRunner(tiny_llm.model, tiny_llm._decoder.cache, 32, 0, "eager")
    assert [runner.key_len(n) for n in (1, 256, 257, 1000, 5000)] == [256, 256, 512, 1024, 4096]


def test_one_key_length_for_the_paged_cache(tiny_llm):
    cache = PagedKVCache(KVCacheConfig(2, 2, 16, 3000), torch.device("cpu"))
    runner = RoundRunner(tiny_llm.model, cache, 32, 0, "eager")
    assert {runner.key_len(n) for n in (1, 256, 257, 1000, 2999)} == {cache.capacity}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graph_replay_matches_eager_on_cuda(tiny_dir, dtype):
    from dlmc import LLM

    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70}
    results = {}
    for mode in ("eager", "compile", "graph"):
        llm = LLM(tiny_dir, device="cuda", dtype=dtype, mode=mode)
        results[mode] = llm.generate(**kwargs)
    # Graph replay runs exactly the compiled kernels: identical tokens in every dtype.
    assert results["graph"].token_ids == results["compile"].token_ids
    assert results["graph"].num_forwards == results["compile"].num_forwards
    if dtype == "fp32":  # in BF16 Inductor's fused kernels round less often than eager ops,
        # and the random tiny model's greedy decoding flips on any rounding change
        assert results["compile"].token_ids == results["eager"].token_ids


@pytest.mark.gpu
def test_round_has_no_host_sync_on_cuda(tiny_dir):
    from dlmc import LLM
    from dlmc.graphs.round import denoise_round

    llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode="eager")
    llm.generate(prompt_token_ids=list(range(40)), max_new_tokens=32)
    runner = llm._decoder.runner(32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the round raises
    try:
        for _ in range(3):
            denoise_round(llm.model, runner.buf, runner.cache, runner.key_len(64), 32,
                          llm.special_ids.mask_token_id, "joint")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_compiled_rounds_with_the_shared_expert_fused(tiny_dir):
    """The fused shared column (`fuse_shared_experts`) compiles with fullgraph=True and gives
    the eager rounds' tokens."""
    from dlmc import LLM
    from dlmc.models.moe import fuse_shared_experts

    llm = LLM(tiny_dir, device="cpu", dtype="fp32")
    assert fuse_shared_experts(llm.model) > 0
    cfg = DecodeConfig(algorithm="joint", threshold=0.8, edit_threshold=0.5,
                       max_refine_steps=4, block_length=16, max_new_tokens=40)
    prompt = list(range(60, 97))
    eager, eager_events, _ = _decode(llm, "eager", prompt, cfg)
    compiled, compiled_events, _ = _decode(llm, "compile", prompt, cfg)
    assert eager.answer_ids == compiled.answer_ids and eager_events == compiled_events


@pytest.mark.gpu
def test_graph_replay_with_the_shared_expert_fused_on_cuda(tiny_dir):
    from dlmc import LLM
    from dlmc.models.moe import fuse_shared_experts

    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70}
    results = {}
    for mode in ("compile", "graph"):
        llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode=mode)
        assert fuse_shared_experts(llm.model) > 0
        results[mode] = llm.generate(**kwargs)
    assert results["graph"].token_ids == results["compile"].token_ids


def _paged_decode(llm, fused: bool, rope_append: bool = False):
    """A paged FP8 decode of the tiny model on the Triton backend (the interpreter on CPU), its
    K/V stored by the attention's kernel (`fused`), by the norm/rope launch (`rope_append`) or
    by `kv_append`: a prefill, a round, and a round fused with the refresh."""
    dec = BlockDecoder(llm.model, llm.special_ids.mask_token_id, llm.special_ids.eos_token_id,
                       64, torch.device("cpu"), torch.bfloat16, kv_cache_dtype="fp8",
                       kernels=KernelConfig(attention_backend="triton"))
    _store_kv(dec.cache, fused, rope_append)
    cfg = DecodeConfig(algorithm="threshold", threshold=0.9, steps=1, block_length=8,
                       max_new_tokens=16)  # one round per block
    gen = dec.decode(list(range(60, 68)), cfg, rounds=True)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return stop.value, events, dec.cache


def _store_kv(cache: PagedKVCache, fused: bool, rope_append: bool) -> None:
    """Where the cache's rounds store K/V: the attention's kernel, the norm/rope launch, or
    `kv_append` (the cache picks one by its dtype; tests try each)."""
    assert cache.backend == "triton"
    cache.fused_append, cache.rope_append = fused, rope_append and not fused


def _assert_same_decode(mine, theirs) -> None:
    """Two `_paged_decode` results: the same tokens, round events and FP8 cache bytes."""
    (result, events, cache), (other, other_events, other_cache) = mine, theirs
    assert result.total_forwards == other.total_forwards == 3
    assert result.answer_ids == other.answer_ids and events == other_events
    for a, b in zip(cache.k + cache.v, other_cache.k + other_cache.v, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert cache.length == 24 and cache.k[0].view(torch.uint8).any()


def test_fused_kv_append_rounds_match_the_separate_append(tiny_dir, monkeypatch):
    """The round with the K/V stored by the attention's kernel (the Triton default) gives the
    tokens, round events and FP8 cache bytes of kv_append + attention."""
    from dlmc import LLM

    llm = LLM(tiny_dir, device="cpu", dtype="bf16")
    fused = _paged_decode(llm, fused=True)
    separate = _paged_decode(llm, fused=False)
    assert fused[0].fused_rounds == 1
    _assert_same_decode(fused, separate)


def test_rope_kv_append_rounds_match_the_separate_append(tiny_dir, monkeypatch):
    """The K/V stored by the norm/rope launch (the FP8 default)
    (`qk_norm_rope_append`) give the tokens, round events and FP8 cache bytes of
    qk_norm_rope + kv_append. On CPU the separate path's norm/rope is the eager reference (the
    kernel only runs on CUDA), so both runs take the Triton `qk_norm_rope` maths here, as on the
    GPU: what differs is only where the K/V are stored from."""
    from dlmc import LLM
    from dlmc.custom_ops.qk_norm_rope import qk_norm_rope
    from dlmc.custom_ops.qk_norm_rope_append import qk_norm_rope_append

    calls = {"append": 0}

    def counted(*args):
        calls["append"] += 1
        return qk_norm_rope_append(*args)

    monkeypatch.setattr("dlmc.models.llada2.qk_norm_rope_append", counted)
    monkeypatch.setattr("dlmc.models.llada2.qk_norm_rope_reference", qk_norm_rope)
    llm = LLM(tiny_dir, device="cpu", dtype="bf16")
    layers = llm.model.config.num_hidden_layers
    folded = _paged_decode(llm, fused=False, rope_append=True)
    assert calls["append"] == 3 * layers  # every forward, every layer
    separate = _paged_decode(llm, fused=False, rope_append=False)
    assert calls["append"] == 3 * layers
    _assert_same_decode(folded, separate)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bf16"])
def test_kv_stores_give_the_same_graph_rounds_on_cuda(tiny_dir, kv_cache_dtype):
    """On CUDA, compiled + graph-replayed rounds with the K/V stored by the attention's kernel,
    by the norm/rope launch and by `kv_append`: the same tokens (each writes kv_append's
    bytes; the attention output is unchanged)."""
    from dlmc.api import LLM

    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70}
    results = {}
    for fused, rope_append in ((True, False), (False, True), (False, False)):
        llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode="graph",
                  kv_cache_dtype=kv_cache_dtype)
        _store_kv(llm._decoder.cache, fused, rope_append)
        results[fused, rope_append] = llm.generate(**kwargs)
    first = results[True, False]
    for other in results.values():
        assert other.token_ids == first.token_ids and other.num_forwards == first.num_forwards
