"""DiffusionGemma's compiled canvas rounds (`canvas_round`, `encode_chunk`, `CanvasRunner`) on a
tiny fp32 model on the CPU: the eager runner decodes what transformers' loop decodes (its draws,
rules and stopping); compiled steps equal eager steps bit for bit from the same buffers and
generator state (several steps, with self-conditioning, over key-length buckets); the stop
flag; graph replays on CUDA."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_rules import denoise_canvas_reference
from dlmc.graphs.canvas_runner import CanvasRunner
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_round_attention import CanvasRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache
from tests.models.gemma_tiny import CANVAS, VOCAB, tiny_model

PROMPT = 13
SETTINGS = {
    # transformers' defaults (with 6 steps): this tiny model never gets confident
    "default": CanvasSettings(canvas_length=CANVAS, max_denoising_steps=6),
    # confident at once: stops at the first step whose argmax repeats the last one (with
    # `_Settling`'s model: the second)
    "stable": CanvasSettings(canvas_length=CANVAS, max_denoising_steps=6,
                             confidence_threshold=100.0),
    # no stability test: stops after the first step
    "confident": CanvasSettings(canvas_length=CANVAS, max_denoising_steps=6,
                                stability_threshold=0, confidence_threshold=100.0),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(11)


class _Settling(torch.nn.Module):
    """The tiny model with a bonus of 12 on the logit of token `7 * position % V`: its argmax
    no longer changes with the (re-noised) canvas, so the stability test can stop a canvas."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = model, model.config

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.inner.lm_head_weight

    def forward(self, tokens, positions, ctx, **kwargs):
        logits = self.inner(tokens, positions, ctx, **kwargs)  # [C, V] (None: encoder)
        bonus = torch.nn.functional.one_hot(7 * positions % VOCAB, VOCAB) * 12.0  # [C, V]
        return None if logits is None else logits + bonus


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path_factory, monkeypatch):
    path = tmp_path_factory.getbasetemp() / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))


def _prompt(seed: int, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _runner(model, settings: CanvasSettings, mode: str, cache: GemmaStaticCache | None = None,
            kernels: KernelConfig = DEFAULT_KERNELS) -> CanvasRunner:
    cache = cache or GemmaStaticCache(model.config, 64, torch.float32, "cpu")
    return CanvasRunner(model, cache, settings, mode, kernels, max_chunk=16, min_bucket=16)


@torch.no_grad()
def transformers_loop(runner: CanvasRunner, canvases: int, seed: int
                      ) -> list[tuple[torch.Tensor, int]]:
    """transformers' loop (`denoise_canvas_reference`: its draws, rules and stopping) over the
    runner's encoder and the same forward as its steps; per canvas the argmax and the decoder
    forwards. (The forward itself is checked against the reference contexts in tests/kv: this
    random model amplifies their last-bit differences from step to step.)"""
    torch.manual_seed(seed)
    runner.reset()
    runner.encode(_prompt(seed))
    out = []
    for _ in range(canvases):
        at = torch.arange(runner.length, runner.length + CANVAS)
        ctx = CanvasRoundAttention(runner.cache, runner.key_len(runner.length))

        def decoder(canvas, sc, at=at, ctx=ctx):  # [1, C], [1, C, V] -> [1, C, V]
            return runner.model(canvas[0], at, ctx, decoder=True,
                                self_conditioning_logits=None if sc is None else sc[0])[None]

        argmax, forwards = denoise_canvas_reference(
            decoder, runner.settings, VOCAB, None, torch.zeros(1, dtype=torch.bool),
            torch.zeros(1, dtype=torch.int64), torch.float32)
        out.append((argmax[0], int(forwards[0])))
        runner.encode(argmax[0])
    return out


def runner_decode(runner: CanvasRunner, canvases: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    torch.manual_seed(seed)
    runner.reset()
    runner.encode(_prompt(seed))
    out = []
    for _ in range(canvases):
        runner.start_canvas()
        while not runner.step():
            pass
        out.append((runner.canvas.argmax.clone(), runner.steps))
        runner.encode(runner.canvas.argmax)
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_eager_runner_decodes_what_transformers_loop_decodes(model, name):
    settings = SETTINGS[name]
    model = _Settling(model) if name == "stable" else model
    want = transformers_loop(_runner(model, settings, "eager"), 3, seed=1)
    got = runner_decode(_runner(model, settings, "eager"), 3, seed=1)
    for (g, g_steps), (w, w_steps) in zip(got, want, strict=True):
        assert torch.equal(g, w) and g_steps == w_steps
    steps = [s for _, s in want]
    assert steps == {"default": [6, 6, 6], "confident": [1, 1, 1], "stable": [2, 2, 2]}[name]


@torch.no_grad()
def test_runner_encoder_fills_the_cache_as_the_reference_encoder(model):
    """A 40-token prompt in chunks of 16 (the last padded to 16), then a canvas: the canvas
    logits over the runner's cache equal those over the reference encoder's cache."""
    runner = _runner(model, SETTINGS["default"], "eager")
    prompt = _prompt(6, 40)
    runner.encode(prompt)
    assert runner.length == int(runner.cache.length) == 40
    reference = GemmaKVCache(model.config.num_hidden_layers)
    model(prompt, torch.arange(40), CausalContext(reference), compute_logits=False)
    canvas, at = _prompt(7, CANVAS), torch.arange(40, 40 + CANVAS)
    want = model(canvas, at, CanvasContext(reference), decoder=True)
    got = model(canvas, at, CanvasRoundAttention(runner.cache, runner.key_len(40)), decoder=True)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def assert_steps_match(eager: CanvasRunner, other: CanvasRunner, seed: int, tol: float) -> None:
    """Two canvases of four steps each over a cache both runners share (the second canvas in
    the next key-length bucket). Each step of `other`, run from the eager step's buffers and
    generator state, computes the same canvas, argmax, acceptance and flags bit for bit and the
    self-conditioning logits and the entropies to `tol`, and leaves the generator where the
    eager step did.
    `other`'s encoder rewrites what the eager encoder wrote to `tol`."""
    cache, device = eager.cache, eager.cache.device
    torch.manual_seed(seed)
    tokens = _prompt(seed)
    for _ in range(2):
        eager.encode(tokens)
        want = [t[:eager.length].clone() for t in (*cache.k, *cache.v)]
        other.encode(tokens)
        for g, w in zip((*cache.k, *cache.v), want, strict=True):
            torch.testing.assert_close(g[:other.length], w, rtol=tol, atol=tol)
        rng = _rng_state(device)
        eager.start_canvas()
        _set_rng_state(rng, device)
        other.start_canvas()
        for _ in range(4):
            before, rng = eager.canvas.snapshot(), _rng_state(device)
            eager_done = eager.step()
            after = _rng_state(device)
            other.canvas.restore(before)
            _set_rng_state(rng, device)
            assert other.step() == eager_done
            assert torch.equal(_rng_state(device), after)
            for name, value in eager.canvas.snapshot().items():
                got = getattr(other.canvas, name)
                if name in ("sc_logits", "entropy"):
                    torch.testing.assert_close(got, value, rtol=tol, atol=tol)
                else:
                    assert torch.equal(got, value), name
        tokens = eager.canvas.argmax.clone()


# the prompt (13 tokens, padded to 16) in bucket 16, the canvases at 13 and 21 in 16 and 32;
# the first canvas encoded at 13..28 (bucket 32)
KEYS = {("encode", 16, 16), ("encode", 16, 32), ("step", True, 16), ("step", False, 16),
        ("step", True, 32), ("step", False, 32)}


def test_compiled_steps_equal_eager_steps(model):
    """`assert_steps_match` with the self-conditioning logits to 1e-4 (Inductor's own fp32
    rounding, which this random model amplifies). The compiled steps take their proposal from
    `dlmc::canvas_propose` (`gemma_sampler="triton"`, the CUDA default; the op mutates the
    self-conditioning buffer inside the compiled step), the eager ones from torch ops."""
    settings = SETTINGS["default"]
    cache = GemmaStaticCache(model.config, 64, torch.float32, "cpu")
    compiled = _runner(model, settings, "compile", cache, KernelConfig(gemma_sampler="triton"))
    assert_steps_match(_runner(model, settings, "eager", cache), compiled, 2, 1e-4)
    assert compiled.compile_s > 0 and set(compiled._graphs) == KEYS


@pytest.mark.gpu
def test_graph_steps_equal_compiled_and_eager_steps():
    """On CUDA: whole bf16 decodes replayed as graphs equal compiled ones bit for bit (the
    same kernels; the captures' warm-up draws undone) and leave the generator alike; in fp32,
    each replayed step equals the eager step from the same state (`assert_steps_match`)."""
    settings = SETTINGS["default"]

    def runner(model, mode: str, cache: GemmaStaticCache | None = None) -> CanvasRunner:
        dtype = model.lm_head_weight.dtype
        return _runner(model, settings, mode,
                       cache or GemmaStaticCache(model.config, 64, dtype, "cuda"))

    bf16 = tiny_model(11, torch.bfloat16, "cuda")
    compiled, graph = runner(bf16, "compile"), runner(bf16, "graph")
    want = runner_decode(compiled, 2, seed=3), torch.cuda.get_rng_state()
    got = runner_decode(graph, 2, seed=3), torch.cuda.get_rng_state()
    for (g, g_steps), (w, w_steps) in zip(got[0], want[0], strict=True):
        assert torch.equal(g, w) and g_steps == w_steps == 6
    assert torch.equal(got[1], want[1])
    fp32 = tiny_model(11, torch.float32, "cuda")
    eager = runner(fp32, "eager")
    graph = runner(fp32, "graph", eager.cache)
    assert_steps_match(eager, graph, 4, 1e-3)
    assert set(graph._graphs) == KEYS and all(g is not None for g in graph._graphs.values())


@pytest.mark.gpu
def test_graph_steps_with_paged_attention_equal_compiled_ones():
    """On CUDA, `gemma_attention="triton"` (dlmc::paged_attention inside the compiled step): a
    graph-replayed bf16 decode equals the compiled one bit for bit (the op's output against
    the plain attention: tests/kv/test_gemma_round_attention.py)."""
    settings, kernels = SETTINGS["default"], KernelConfig(gemma_attention="triton")
    bf16 = tiny_model(12, torch.bfloat16, "cuda")

    def runner(mode: str, cache: GemmaStaticCache | None = None) -> CanvasRunner:
        cache = cache or GemmaStaticCache(bf16.config, 64, torch.bfloat16, "cuda")
        return _runner(bf16, settings, mode, cache, kernels)

    compiled, graph = runner("compile"), runner("graph")
    want = runner_decode(compiled, 2, seed=5)
    got = runner_decode(graph, 2, seed=5)
    for (g, g_steps), (w, w_steps) in zip(got, want, strict=True):
        assert torch.equal(g, w) and g_steps == w_steps


def test_stop_flag_and_step_budget(model):
    confident = _runner(model, SETTINGS["confident"], "eager")
    confident.encode(_prompt(3))
    confident.start_canvas()
    assert confident.step() is True
    assert bool(confident.canvas.stopped) and int(confident.canvas.steps_remaining) == 5
    budget = _runner(model, SETTINGS["default"], "eager")
    budget.encode(_prompt(3))
    budget.start_canvas()
    flags = [budget.step() for _ in range(6)]
    assert flags == [False] * 5 + [True] and not bool(budget.canvas.stopped)
    assert int(budget.canvas.steps_remaining) == 0
    # a stopped canvas stays frozen if stepped again
    frozen = confident.canvas.snapshot()
    assert confident.step() is True
    for name in ("tokens", "argmax", "sc_logits", "stopped"):
        assert torch.equal(getattr(confident.canvas, name), frozen[name]), name


def test_an_eager_step_of_a_compile_mode_runner_compiles_nothing(model):
    """`step(eager=True)` (a benchmark's canvas-opening step) computes what an eager runner's
    step does, leaves the generator alike, and neither compiles nor records a step."""
    eager = _runner(model, SETTINGS["default"], "eager")
    other = _runner(model, SETTINGS["default"], "compile", eager.cache)
    eager.encode(_prompt(6))
    other.length = eager.length
    after = []
    for runner in (eager, other):
        torch.manual_seed(8)
        runner.start_canvas()
        assert runner.step(eager=True) is False
        after.append(torch.rand(3))
    assert torch.equal(after[0], after[1])
    for name, value in eager.canvas.snapshot().items():
        assert torch.equal(getattr(other.canvas, name), value), name
    assert bool((eager.canvas.sc_logits != 0).any())  # the step did run
    assert other._graphs == {} and other.compile_s == 0.0 and other.steps == 1


def test_start_canvas_draws_even_a_given_canvas(model):
    runner = _runner(model, SETTINGS["default"], "eager")
    runner.encode(_prompt(4))
    given = torch.arange(CANVAS)
    torch.manual_seed(5)
    runner.start_canvas(given)
    after_given = torch.rand(3)
    torch.manual_seed(5)
    runner.start_canvas()
    drawn = runner.canvas.tokens.clone()
    assert torch.equal(torch.rand(3), after_given) and not torch.equal(drawn, given)
    assert torch.equal(runner.canvas.positions, torch.arange(PROMPT, PROMPT + CANVAS))
    assert int(runner.canvas.steps_remaining) == 6 and (runner.canvas.history == -1).all()
    with pytest.raises(ConfigError, match=r"canvas must have shape \(8,\)"):
        runner.start_canvas(torch.arange(4))
    torch.manual_seed(5)
    runner.start_canvas(given, draw=False)  # drawn by the caller: nothing drawn here
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(runner.canvas.tokens, given)
    with pytest.raises(ConfigError, match="draw=False needs the canvas"):
        runner.start_canvas(draw=False)


def test_runner_checks_its_arguments(model):
    cache = GemmaStaticCache(model.config, 32, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="canvas round mode 'graph' needs a CUDA device"):
        CanvasRunner(model, cache, SETTINGS["default"], "graph")
    with pytest.raises(ConfigError, match="canvas round mode 'fast'"):
        CanvasRunner(model, cache, SETTINGS["default"], "fast")
    with pytest.raises(ConfigError, match="max_chunk must be a power of two, got 24"):
        CanvasRunner(model, cache, SETTINGS["default"], "eager", max_chunk=24)
    runner = CanvasRunner(model, cache, SETTINGS["default"], "eager", min_bucket=16)
    assert [runner.key_len(n) for n in (0, 16, 17, 40)] == [16, 16, 32, 32]
    runner.encode(torch.arange(30))
    with pytest.raises(ConfigError, match=r"30 \+ 3 tokens > max_tokens=32"):
        runner.encode(torch.arange(3))



def test_triton_sampler_steps_equal_torch_steps(model):
    """`gemma_sampler="triton"` (`dlmc::canvas_propose`, under the interpreter here; it writes
    the self-conditioning input in place, kept for stopped rows): each eager step equals the
    torch sampler's eager step from the same state, up to fp32 summation order in the
    entropies (the compiled form: `test_compiled_steps_equal_eager_steps`)."""
    settings = SETTINGS["default"]
    cache = GemmaStaticCache(model.config, 64, torch.float32, "cpu")
    triton = _runner(model, settings, "eager", cache, KernelConfig(gemma_sampler="triton"))
    assert triton._triton_sampler and not _runner(model, settings, "eager", cache)._triton_sampler
    assert_steps_match(_runner(model, settings, "eager", cache), triton, 3, 1e-5)
