"""The round function: eager and compiled give identical tokens; compiled with fullgraph=True
(which fails on any host sync or graph break inside the round)."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from dlmc.engine.block_decoder import BlockDecoder
from dlmc.engine.decode_config import DecodeConfig
from dlmc.errors import ConfigError
from dlmc.graphs.runner import (
    RoundRunner,
    compile_options,
    inductor_cache_dir,
    kernel_switches,
)
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


def test_compile_options_from_the_environment(monkeypatch):
    monkeypatch.delenv("DLMC_MAX_AUTOTUNE_GEMM", raising=False)
    monkeypatch.delenv("DLMC_UNROLL_REDUCTIONS", raising=False)
    monkeypatch.delenv("DLMC_DETERMINISTIC_COMPILE", raising=False)
    monkeypatch.delenv("DLMC_INDUCTOR_PDL", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    assert compile_options() == {"unroll_reductions_threshold": 8, "triton.enable_pdl": True}
    monkeypatch.setenv("DLMC_MAX_AUTOTUNE_GEMM", "1")
    monkeypatch.setenv("DLMC_UNROLL_REDUCTIONS", "16")
    monkeypatch.setenv("DLMC_INDUCTOR_PDL", "0")
    assert compile_options() == {"max_autotune_gemm": True, "unroll_reductions_threshold": 16,
                                 "triton.enable_pdl": False}
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")  # the user's own switch stands
    assert "triton.enable_pdl" not in compile_options()
    monkeypatch.setenv("DLMC_INDUCTOR_PDL", "on")
    with pytest.raises(ConfigError, match="DLMC_INDUCTOR_PDL='on'"):
        compile_options()
    monkeypatch.setenv("DLMC_INDUCTOR_PDL", "1")
    monkeypatch.setenv("DLMC_MAX_AUTOTUNE_GEMM", "yes")
    with pytest.raises(ConfigError, match="DLMC_MAX_AUTOTUNE_GEMM='yes'"):
        compile_options()
    monkeypatch.setenv("DLMC_MAX_AUTOTUNE_GEMM", "0")
    for bad in ("0", "x", "65"):
        monkeypatch.setenv("DLMC_UNROLL_REDUCTIONS", bad)
        with pytest.raises(ConfigError, match=f"DLMC_UNROLL_REDUCTIONS='{bad}'"):
            compile_options()



def test_deterministic_compile_switch(monkeypatch):
    """DLMC_DETERMINISTIC_COMPILE=1 turns on Inductor's deterministic mode, an option this torch
    has and that changes Inductor's cache key (so it also gets its own cache directory)."""
    monkeypatch.delenv("DLMC_MAX_AUTOTUNE_GEMM", raising=False)
    monkeypatch.delenv("DLMC_UNROLL_REDUCTIONS", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    monkeypatch.setenv("DLMC_DETERMINISTIC_COMPILE", "1")
    options = compile_options()
    assert options == {"unroll_reductions_threshold": 8, "deterministic": True,
                       "triton.enable_pdl": True}
    # every option is one this torch's Inductor has (a dotted name: a sub-config's field)
    for name in options:
        config = torch._inductor.config
        *parents, field = name.split(".")
        for parent in parents:
            config = getattr(config, parent)
        assert hasattr(config, field), name
    assert "DLMC_DETERMINISTIC_COMPILE=1" in kernel_switches()
    monkeypatch.setenv("DLMC_DETERMINISTIC_COMPILE", "on")
    with pytest.raises(ConfigError, match="DLMC_DETERMINISTIC_COMPILE='on'"):
        compile_options()


def _paged_decode(llm, monkeypatch, fused: str, rope_append: str = "off"):
    """A paged FP8 decode of the tiny model on the Triton backend (the interpreter on CPU) with
    DLMC_FUSED_KV_APPEND=`fused` and DLMC_ROPE_KV_APPEND=`rope_append`: a prefill, a round,
    and a round fused with the refresh."""
    monkeypatch.setenv("DLMC_FUSED_KV_APPEND", fused)
    monkeypatch.setenv("DLMC_ROPE_KV_APPEND", rope_append)
    monkeypatch.setattr("dlmc.kv.paged_cache.default_backend", lambda device: "triton")
    dec = BlockDecoder(llm.model, llm.special_ids.mask_token_id, llm.special_ids.eos_token_id,
                       64, torch.device("cpu"), torch.bfloat16, kv_cache_dtype="fp8")
    assert dec.cache.backend == "triton" and dec.cache.fused_append == (fused == "on")
    assert dec.cache.rope_append == (fused != "on" and rope_append == "on")
    cfg = DecodeConfig(algorithm="threshold", threshold=0.9, steps=1, block_length=8,
                       max_new_tokens=16)  # one round per block
    gen = dec.decode(list(range(60, 68)), cfg, rounds=True)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return stop.value, events, dec.cache


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
    fused = _paged_decode(llm, monkeypatch, "on")
    separate = _paged_decode(llm, monkeypatch, "off")
    assert fused[0].fused_rounds == 1
    _assert_same_decode(fused, separate)


def test_rope_kv_append_rounds_match_the_separate_append(tiny_dir, monkeypatch):
    """With DLMC_ROPE_KV_APPEND=on (the FP8 default) the K/V stored by the norm/rope launch
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
    folded = _paged_decode(llm, monkeypatch, "off", rope_append="on")
    assert calls["append"] == 3 * layers  # every forward, every layer
    separate = _paged_decode(llm, monkeypatch, "off", rope_append="off")
    assert calls["append"] == 3 * layers
    _assert_same_decode(folded, separate)


@pytest.mark.gpu
def test_fused_kv_append_graph_rounds_match_the_separate_append_on_cuda(tiny_dir, monkeypatch):
    """On CUDA, compiled + graph-replayed rounds with DLMC_FUSED_KV_APPEND on and off: the
    same tokens (the op writes kv_append's bytes; the attention output is unchanged)."""
    from dlmc import LLM

    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70}
    results = {}
    for fused in ("on", "off"):
        monkeypatch.setenv("DLMC_FUSED_KV_APPEND", fused)
        for kv_cache_dtype in ("fp8", "bf16"):
            llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode="graph",
                      kv_cache_dtype=kv_cache_dtype)
            assert llm._decoder.cache.fused_append == (fused == "on")
            results[fused, kv_cache_dtype] = llm.generate(**kwargs)
    for kv_cache_dtype in ("fp8", "bf16"):
        on, off = results["on", kv_cache_dtype], results["off", kv_cache_dtype]
        assert on.token_ids == off.token_ids and on.num_forwards == off.num_forwards


@pytest.mark.gpu
def test_rope_kv_append_graph_rounds_match_the_separate_append_on_cuda(tiny_dir, monkeypatch):
    """On CUDA, compiled + graph-replayed FP8 rounds with DLMC_ROPE_KV_APPEND on and off: the
    same tokens (qk_norm_rope_append stores kv_append's bytes and returns qk_norm_rope's q/k/v)."""
    from dlmc import LLM

    monkeypatch.delenv("DLMC_FUSED_KV_APPEND", raising=False)
    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 70}
    results = {}
    for rope_append in ("on", "off"):
        monkeypatch.setenv("DLMC_ROPE_KV_APPEND", rope_append)
        llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode="graph", kv_cache_dtype="fp8")
        assert llm._decoder.cache.rope_append == (rope_append == "on")
        results[rope_append] = llm.generate(**kwargs)
    assert results["on"].token_ids == results["off"].token_ids
    assert results["on"].num_forwards == results["off"].num_forwards
def test_inductor_cache_dir_is_per_kernel_switches(monkeypatch, tmp_path):
    """Switches that change the bodies of dlmc's ops get their own Inductor cache."""
    for name in [k for k in os.environ if k.startswith("DLMC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DLMC_CACHE", str(tmp_path))
    monkeypatch.setattr("dlmc.graphs.runner.USER_INDUCTOR_CACHE_DIR", None)  # the user's: none
    dirs = []
    for switches in ({}, {"DLMC_MOE_COMBINE": "inductor"}, {"DLMC_MOE_COMBINE": "triton"},
                     {"DLMC_MOE_COMBINE": "triton", "DLMC_NVFP4_KERNEL": "v5"}):
        for name in ("DLMC_MOE_COMBINE", "DLMC_NVFP4_KERNEL"):
            monkeypatch.delenv(name, raising=False)
        for name, value in switches.items():
            monkeypatch.setenv(name, value)
        # set by Inductor itself to its default: not the user's choice, replaced
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_default")
        assert kernel_switches() == " ".join(f"{k}={v}" for k, v in sorted(switches.items()))
        dirs.append(inductor_cache_dir())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == dirs[-1]
        assert dirs[-1].startswith(str(tmp_path))
    assert dirs[0].endswith("inductor") and len(set(dirs)) == 4
    monkeypatch.setattr("dlmc.graphs.runner.USER_INDUCTOR_CACHE_DIR", "/elsewhere")
    assert inductor_cache_dir() == "/elsewhere" == os.environ["TORCHINDUCTOR_CACHE_DIR"]


_IMPORT_RUNNER = """
import os, sys
import dlmc.graphs.runner as runner
print(repr(runner.USER_INDUCTOR_CACHE_DIR))
os.environ["DLMC_CACHE"] = sys.argv[1]
print(runner.inductor_cache_dir())
"""


@pytest.mark.parametrize("user_dir", [None, "elsewhere"])
def test_a_fresh_process_tells_the_users_cache_dir_from_inductors_default(tmp_path, user_dir):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to Inductor's default before the
    runner reads it: unset by the user, the process still gets dlmc's per-switch directory."""
    env = {k: v for k, v in os.environ.items()
           if k != "TORCHINDUCTOR_CACHE_DIR" and not k.startswith("DLMC_")}
    if user_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / user_dir)
    env["DLMC_PDL"] = "opaque"
    proc = subprocess.run([sys.executable, "-c", _IMPORT_RUNNER, str(tmp_path / "dlmc")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen, used = proc.stdout.strip().splitlines()[-2:]
    if user_dir:
        assert seen == repr(str(tmp_path / user_dir)) and used == str(tmp_path / user_dir)
    else:
        assert seen == "None"
        digest = hashlib.sha256(b"DLMC_PDL=opaque").hexdigest()[:12]
        assert used == str(tmp_path / "dlmc" / f"inductor-{digest}")
