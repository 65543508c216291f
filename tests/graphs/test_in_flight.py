"""Rounds in flight: the done flags' host reads, the guard of a queued round, and graph-mode
decoding with a round in flight against rounds one by one (GPU)."""

import pytest
import torch

from dlmc.engine.block_decoder import BlockDecoder
from dlmc.errors import ConfigError
from dlmc.graphs import in_flight
from dlmc.graphs.in_flight import SLOTS, DoneReads, guarded_capture_problem, run_if_not
from tests.engine.scripted import EOS, MASK, ScriptedModel, logits_for


def test_done_reads_give_each_queued_rounds_flag():
    flag = torch.zeros((), dtype=torch.bool)
    reads = DoneReads(flag)
    first = reads.queue()
    flag.fill_(True)
    second = reads.queue()
    flag.fill_(False)
    assert reads.read(first) is False and reads.read(second) is True
    slots = [reads.queue() for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match=f"more than {SLOTS} done flags queued"):
        reads.queue()
    assert reads.read(slots[0]) is False
    reads.drop()  # the three unread slots are free again
    assert len({reads.queue() for _ in range(SLOTS)}) == SLOTS


def test_guarded_capture_problem_names_the_cause(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert guarded_capture_problem() == "torch is not a CUDA build"
    monkeypatch.setattr(torch.version, "cuda", "12.2")
    assert "need CUDA 12.4 or later (torch built with 12.2)" in guarded_capture_problem()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    if hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):  # (not in CPU builds)
        assert guarded_capture_problem() is None
        monkeypatch.setattr(torch.cuda, "CUDAGraph", type("OldGraph", (), {}))
    assert "has no CUDA graph conditional nodes" in guarded_capture_problem()
    flag = torch.zeros((), dtype=torch.bool)
    with (pytest.raises(ConfigError, match="cannot be captured: .*; pass lookahead=False"),
          run_if_not(None, flag, flag.clone())):
        pass


def test_a_guarded_round_skips_a_finished_block():
    model = ScriptedModel(lambda i, t: logits_for([1] * 4, [0.3] * 4))
    dec = BlockDecoder(model, MASK, EOS, 256, torch.device("cpu"), torch.float32)
    runner = dec.runner(4)
    runner.buf.positions.copy_(torch.arange(8, 12))
    runner.buf.editable.fill_(True)
    runner.buf.tokens.fill_(MASK)
    runner.buf.max_post.fill_(4)
    runner.buf.threshold.fill_(0.85)
    runner.buf.done.fill_(True)
    runner.launch_guarded("joint", runner.key_len(12))
    assert model.calls == 0 and (runner.buf.tokens == MASK).all()
    runner.buf.done.fill_(False)
    runner.launch_guarded("joint", runner.key_len(12))
    assert model.calls == 1 and int(runner.buf.step) == 1 and (runner.buf.tokens != MASK).sum() == 1


def test_graph_mode_without_conditional_nodes_runs_rounds_one_by_one(monkeypatch, caplog):
    monkeypatch.setattr(in_flight, "guarded_capture_problem", lambda: "no conditional nodes here")
    monkeypatch.setattr("dlmc.engine.block_decoder.guarded_capture_problem",
                        in_flight.guarded_capture_problem)
    with caplog.at_level("INFO", logger="dlmc.engine.block_decoder"):
        dec = BlockDecoder(ScriptedModel(lambda i, t: None), MASK, EOS, 64, torch.device("cpu"),
                           torch.float32, mode="graph")
    assert dec.lookahead is False
    assert "rounds one by one, not in flight: no conditional nodes here" in caplog.text
    eager = BlockDecoder(ScriptedModel(lambda i, t: None), MASK, EOS, 64, torch.device("cpu"),
                         torch.float32, mode="eager")
    assert eager.lookahead is True  # outside graphs the guard reads the flag on the host


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["bf16", "nvfp4"])
def test_graph_rounds_in_flight_equal_rounds_one_by_one_on_cuda(tiny_dir, nvfp4_dir, checkpoint):
    """Graph mode with a round in flight (conditional-node guarded replays) gives the tokens
    and counts of rounds one by one; NVFP4 puts the op's PDL launches and the FP8 cache's
    attention inside the conditional body."""
    from dlmc import LLM

    model_dir = tiny_dir if checkpoint == "bf16" else nvfp4_dir
    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 96}
    results = {}
    for lookahead in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="bf16", mode="graph", lookahead=lookahead)
        assert llm._decoder.lookahead is lookahead
        results[lookahead] = llm.generate(**kwargs)
        if lookahead:
            keys = llm._decoder.runner(llm.decode_settings().block_length)._graphs
            assert any(key[0] == "guarded" for key in keys)
    assert results[True].token_ids == results[False].token_ids
    assert results[True].num_forwards == results[False].num_forwards
    assert results[True].num_forwards > results[True].blocks


@pytest.mark.gpu
def test_guarded_graph_round_on_a_finished_block_changes_nothing_on_cuda(nvfp4_dir):
    from dlmc import LLM

    llm = LLM(nvfp4_dir, device="cuda", dtype="bf16", mode="graph")
    llm.generate(prompt_token_ids=list(range(50, 90)), max_new_tokens=64)  # captures the graphs
    runner = llm._decoder.runner(llm.decode_settings().block_length)
    cache = llm._decoder.cache
    key_len = runner.key_len(128)
    assert ("guarded", "joint", key_len) in runner._graphs
    buf = runner.buf
    buf.tokens.fill_(llm.special_ids.mask_token_id)
    buf.done.fill_(True)
    before = {name: t.clone() for name, t in vars(buf).items()}
    pools = [t.clone() for t in [*cache.k, *cache.v]]
    runner.launch_guarded("joint", key_len)
    torch.cuda.synchronize()
    assert all(torch.equal(before[name], t) for name, t in vars(buf).items())
    assert all(torch.equal(a, b) for a, b in zip(pools, [*cache.k, *cache.v], strict=True))
    buf.done.fill_(False)
    runner.launch_guarded("joint", key_len)
    torch.cuda.synchronize()
    assert int(buf.step) == int(before["step"]) + 1
    assert not all(torch.equal(a, b) for a, b in zip(pools, [*cache.k, *cache.v], strict=True))

