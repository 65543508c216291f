"""DiffusionGemma's compiled canvas modes through `LLM` (CPU compile; graph on CUDA): the same
tokens and step decisions as the eager mode from the same seed, the caller's default generator
left as it was, the seeded generator swapped in per step, and the modes' errors.

Exact trajectories are compared at two denoising steps per canvas: compiled logits equal eager
ones to fp32 rounding (Inductor's fusion, key-length buckets, padded encoder chunks), and the
tiny random model's self-conditioning amplifies a difference of 1e-6 in its input some
hundredfold per step, so from the third step on the modes take different (equally valid)
samples even in fp32. Each step's equality from the same state is `tests/graphs`'s."""

from __future__ import annotations

import pytest
import torch

from dlmc.engine.canvas_compiled import MIN_CACHE_TOKENS, drawing_from
from dlmc.engine.canvas_decoder import CanvasDecoder
from dlmc.engine.canvas_steppers import make_stepper
from dlmc.errors import ConfigError
from dlmc.results import CanvasRoundEvent, Done

CHAT = [{"role": "user", "content": "Hi"}]
TWO_STEPS = {"max_new_tokens": 128, "max_denoising_steps": 2}


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ind"))


def _decode(llm, seed: int) -> tuple[list[tuple], object]:
    """(every step's (tokens, accepted, argmax), the result) of one seeded chat request."""
    events = list(llm.stream(messages=CHAT, seed=seed, rounds=True, **TWO_STEPS))
    done = events[-1]
    assert isinstance(done, Done)
    steps = [(e.tokens, e.accepted, e.argmax, e.mean_entropy) for e in events
             if isinstance(e, CanvasRoundEvent)]
    return steps, done.result


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(got: tuple[list[tuple], object], want: tuple[list[tuple], object]) -> None:
    (got_steps, got_res), (want_steps, want_res) = got, want
    assert [s[:3] for s in got_steps] == [s[:3] for s in want_steps]
    # mean entropies: first steps to 1e-5, second ones through the amplification to 1e-3
    assert [s[3] for s in got_steps] == pytest.approx([s[3] for s in want_steps], rel=1e-3)
    assert got_steps[0][3] == pytest.approx(want_steps[0][3], rel=1e-5)
    assert got_res.token_ids == want_res.token_ids and got_res.blocks == want_res.blocks
    assert (got_res.num_forwards, got_res.total_forwards, got_res.finish_reason) == (
        want_res.num_forwards, want_res.total_forwards, want_res.finish_reason)


def test_compile_generates_what_eager_generates(tiny_gemma_dir, tiny_gemma_llm):
    from dlmc import LLM

    llm = LLM(tiny_gemma_dir, device="cpu", dtype="fp32", mode="compile")
    results = []
    for seed in (0, 1):
        want = _decode(tiny_gemma_llm, seed)
        torch.manual_seed(123)
        got = _decode(llm, seed)
        # the caller's default generator: as seeded, whatever the request drew
        assert torch.equal(torch.rand(4), torch.rand(4, generator=_seeded(123)))
        _same(got, want)
        results.append(want[1])
    assert llm.mode == "compile" and results[0].settings["mode"] == "eager"
    assert results[0].token_ids != results[1].token_ids
    assert max(r.blocks for r in results) > 1  # appended canvases went through the encoder
    runner = llm._canvas.decoder.stepper(True).runner
    assert runner.compile_s > 0 and runner.cache.max_tokens == MIN_CACHE_TOKENS
    assert {key[0] for key in runner._graphs} == {"encode", "step"}


def test_compile_with_an_fp8_cache_generates_what_eager_generates(tiny_gemma_dir):
    """An FP8 static cache (fp32 activations): compiled encoder chunks quantize K/V as the eager
    ones do and compiled steps read them dequantized alike, so the decodes match."""
    from dlmc import LLM

    eager, compiled = (LLM(tiny_gemma_dir, device="cpu", dtype="fp32", kv_cache_dtype="fp8",
                           mode=mode) for mode in ("eager", "compile"))
    _same(_decode(compiled, 0), _decode(eager, 0))
    runner = compiled._canvas.decoder.stepper(True).runner
    assert runner.cache.k[0].dtype == torch.float8_e4m3fn and compiled.kv_cache_dtype == "fp8"
    assert int(runner.cache.length) > 0 and runner.cache.k[0][:4].float().abs().sum() > 0


def test_drawing_from_swaps_the_generator_in_and_out():
    torch.manual_seed(7)
    mine = _seeded(5)
    with drawing_from(mine):
        inside = torch.rand(3)  # the default generator, drawing `mine`'s stream
    after_mine = torch.rand(2, generator=mine)
    stream = _seeded(5)
    assert torch.equal(inside, torch.rand(3, generator=stream))
    assert torch.equal(after_mine, torch.rand(2, generator=stream))  # `mine` moved on
    assert torch.equal(torch.rand(3), torch.rand(3, generator=_seeded(7)))
    with pytest.raises(ValueError), drawing_from(mine):
        raise ValueError  # the default generator is put back on an error too
    assert torch.equal(torch.rand(3), torch.rand(6, generator=_seeded(7))[3:])


def test_mode_errors(tiny_gemma_llm):
    """(`LLM`'s own: tests/test_api_gemma.py.)"""
    model, cpu = tiny_gemma_llm.model, torch.device("cpu")
    with pytest.raises(ConfigError, match=r"mode 'graph' \(CUDA graphs\) needs a CUDA device"):
        CanvasDecoder(model, cpu, "graph")
    with pytest.raises(ConfigError, match="mode 'fast': expected one of graph, compile, eager, "
                                          "reference"):
        CanvasDecoder(model, cpu, "fast")
    with pytest.raises(ConfigError, match="mode 'compile' decodes over the KV cache only; "
                                          "use_cache=False .* runs in modes 'eager'"):
        make_stepper("compile", model, cpu, use_cache=False)
    stepper = make_stepper("compile", model, cpu)
    with pytest.raises(RuntimeError, match=r"before reset\(\)"):
        stepper.encode(torch.tensor([2, 300]), 0)


@pytest.mark.gpu
def test_graph_generates_what_compile_generates(tiny_gemma_dir):
    """On CUDA (bf16, the default dtype): graph mode, the default, replays compile mode's
    kernels, so whole decodes are identical at any number of steps; the default CUDA
    generator is left as it was."""
    from dlmc import LLM

    graph = LLM(tiny_gemma_dir, device="cuda")
    compiled = LLM(tiny_gemma_dir, device="cuda", mode="compile")
    assert graph.mode == "graph"
    kwargs = {"max_new_tokens": 96, "max_denoising_steps": 6}
    for seed in (0, 1):
        want = list(compiled.stream(messages=CHAT, seed=seed, rounds=True, **kwargs))
        torch.cuda.manual_seed(9)
        got = list(graph.stream(messages=CHAT, seed=seed, rounds=True, **kwargs))
        assert torch.equal(torch.cuda.get_rng_state(), _cuda_state_after_seed(9))
        assert [e for e in got if isinstance(e, CanvasRoundEvent)] == [
            e for e in want if isinstance(e, CanvasRoundEvent)]
        assert got[-1].result.token_ids == want[-1].result.token_ids
    runner = graph._canvas.decoder.stepper(True).runner
    assert runner._graphs and all(g is not None for g in runner._graphs.values())


def _cuda_state_after_seed(seed: int) -> torch.Tensor:
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return state
