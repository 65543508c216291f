"""`loop_overhead` (the whole-decode part of `dlmc bench round`) on the CPU with the tiny model:
both refresh modes decode the same tokens' worth of rounds and count their forwards."""

import pytest

from dlmc.bench.round_bench import RoundBenchConfig, launch_line, loop_overhead


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    from dlmc import LLM

    return LLM(tiny_dir, device="cpu", dtype="bf16")


def test_loop_overhead_counts_fused_and_separate_refreshes(tiny_bf16):
    bench = RoundBenchConfig(block_length=16, prefix=48, rounds=3, modes=("eager",))
    mask = tiny_bf16.special_ids.mask_token_id
    runs = {refresh: loop_overhead(tiny_bf16.model, bench, mask, round_ms=1.0, blocks=3,
                                   refresh=refresh, mode="eager")
            for refresh in ("fused", "separate")}
    fused, separate = runs["fused"], runs["separate"]
    assert separate["fused_rounds"] == 0 and separate["fused_round_ms_median"] == 0.0
    # One prefill chunk (48 prompt tokens = 3 blocks of 16, in one chunk of 512 // 16 * 16),
    # timed as a chunk of its own; separate: one refresh per block (but the last) whose last
    # round changed it; fused: the same refreshes ride on the next block's first round instead.
    refreshes = separate["fill_forwards"]
    assert refreshes >= 1  # the tiny model's blocks end with a changing round: refreshes happen
    assert fused["fill_forwards"] == 0 and fused["fused_rounds"] == refreshes
    assert fused["fused_rounds"] == 0 or fused["fused_round_ms_median"] > 0
    for run in runs.values():
        assert run["wall_ms"] > 0 and run["sum_of_forwards_ms"] > 0 and run["blocks"] == 3
        assert (run["prefill_chunks"], run["prefill_chunk_tokens"]) == (1, 512)
        assert run["prefill_ms_median"] > 0 and run["round_ms"] == 1.0
        plain = run["rounds"] - run["fused_rounds"]
        assert run["sum_of_forwards_ms"] == pytest.approx(
            plain * 1.0 + run["fused_rounds"] * run["fused_round_ms_median"]
            + run["prefill_ms_median"] + run["fill_forwards"] * run["fill_ms_median"])


def test_uniform_routing_and_touched_bytes_with_the_shared_expert_fused(tiny_dir):
    """FixedRouter's [T, K] routing + the fused shared column: same outputs (fp32) as unfused,
    and the same bytes touched (the shared expert is one more touched expert)."""
    import torch

    from dlmc.bench.round_bench import (
        FixedRouter,
        UniformRoutingMoE,
        touched_bytes,
        use_uniform_routing,
    )
    from dlmc.kv.attention import MaskedAttention, block_causal_mask
    from dlmc.loading.loader import load_model
    from dlmc.models.moe import MoEBlock, fuse_shared_experts

    model = load_model(tiny_dir, torch.device("cpu"), torch.float32).model
    use_uniform_routing(model, max_tokens=64, seed=0)
    wrappers = [layer.mlp for layer in model.model.layers
                if isinstance(layer.mlp, UniformRoutingMoE)]
    assert wrappers and all(isinstance(w.block, MoEBlock) and isinstance(w.block.gate, FixedRouter)
                            for w in wrappers)
    real_calls = []  # the model's own routers still run, once per block and forward
    for w in wrappers:
        w.block.gate.router.register_forward_hook(lambda *a: real_calls.append(1))
    tokens, positions = torch.arange(16), torch.arange(48, 64)
    mask = block_causal_mask(positions, positions, 16, torch.float32)
    with torch.inference_mode():
        want = model(tokens, positions, MaskedAttention(mask))
    assert len(real_calls) == len(wrappers)
    before = touched_bytes(model, tokens, positions, prefix=48)
    assert fuse_shared_experts(model) > 0
    with torch.inference_mode():
        got = model(tokens, positions, MaskedAttention(mask))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert touched_bytes(model, tokens, positions, prefix=48) == before
    # gate + up of the dense layer in one weight: same outputs, same bytes (views count once)
    from dlmc.models.layers import fuse_gate_up_projections

    assert fuse_gate_up_projections(model) > 0
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, positions, MaskedAttention(mask)), want,
                                   rtol=1e-5, atol=1e-5)
    assert touched_bytes(model, tokens, positions, prefix=48) == before


def test_in_flight_times_time_rounds_that_ran(tiny_bf16):
    """`in_flight_times` (the bench's decode-loop pattern) on the CPU: one time per round over
    whole blocks of `block_length` filling rounds and their post-fill rounds."""
    import torch

    from dlmc.bench.round_bench import in_flight_times
    from dlmc.graphs.runner import RoundRunner

    dec = tiny_bf16._decoder
    mask = tiny_bf16.special_ids.mask_token_id
    runner = RoundRunner(tiny_bf16.model, dec.cache, 8, mask, "eager")
    runner.buf.positions.copy_(torch.arange(32, 40))
    runner.buf.editable.fill_(True)
    launches = []
    launch = runner.launch
    runner.launch = lambda *a: (launches.append(int(runner.buf.step)), launch(*a))
    times = in_flight_times(runner, runner.key_len(40), rounds=12, mask_id=mask)
    assert len(times) == 12 and all(t > 0 for t in times)
    # Blocks of 8 filling rounds + 1 or 2 post-fill rounds (one allowed), then a new block.
    first = launches.index(0, 1)
    assert first in (9, 10) and launches[:first] == list(range(first))
    assert launches.count(0) == 2  # two blocks: 8 or 9 times from the first, the rest after


def test_launch_line_counts_the_rows_with_device_time_per_round_and_layer():
    """Kernel rows (device time of their own) count with their calls; host-side rows (an aten
    op whose time is its kernels') do not."""
    from types import SimpleNamespace as Row

    rows = [Row(count=40, self_device_time_total=120.0),  # a kernel, 4 calls per round
            Row(count=10, self_device_time_total=3.5),  # a memset, 1 per round
            Row(count=40, self_device_time_total=0.0)]  # aten::mm: host side
    line = launch_line(rows, rounds=10, layers=2)
    assert line.startswith("device launches per round: 5 = 2.5 per layer over 2 layers")
    with pytest.raises(ValueError, match="rounds and layers must be >= 1"):
        launch_line(rows, rounds=0, layers=2)
