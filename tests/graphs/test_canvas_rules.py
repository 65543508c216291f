"""The canvas decoding rules against transformers' own DiffusionGemma generation code (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation import EosTokenCriteria, LogitsProcessorList, StoppingCriteriaList
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationMixin,
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from dlmc.graphs.canvas_rules import (
    accept_mask,
    canvas_step,
    canvas_step_reference,
    draw_step_noise,
    finish_canvas,
    initial_state,
    propose,
    self_conditioning_input,
    stop_test,
    temperature,
    token_entropy,
    tokens_per_forward,
)
from dlmc.graphs.canvas_settings import CanvasSettings

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _logits(seed: int, shape: tuple[int, ...], scale: float, ties: bool) -> torch.Tensor:
    """Soft-capped fp32 logits `shape` (`[..., C, V]`); `ties`: every position a copy of the
    first (equal entropies everywhere, so the sort's tie order decides acceptance)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(shape, generator=gen) * scale  # [..., C, V]
    if ties:
        raw = raw[..., :1, :].expand(shape).clone()
    return 30.0 * torch.tanh(raw / 30.0)


def _hf_parts(s: CanvasSettings, vocab_size: int):
    sampler = EntropyBoundSampler(
        EntropyBoundSamplerConfig(entropy_bound=float(s.entropy_bound)),
        canvas_length=s.canvas_length, vocab_size=vocab_size,
        max_denoising_steps=s.max_denoising_steps,
    )
    processors = LogitsProcessorList(
        [LinearTemperatureScheduleLogitsProcessor(s.t_min, s.t_max, s.max_denoising_steps)]
    )
    stopping = StableAndConfidentStoppingCriteria(s.stability_threshold, s.confidence_threshold)
    return sampler, processors, stopping


def _fake_model(vocab_size: int) -> SimpleNamespace:
    """What `_denoising_step` reads from `self`: the vocabulary size and the embedding dtype."""
    weight = torch.empty(0, dtype=torch.bfloat16)
    return SimpleNamespace(
        config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=vocab_size)),
        model=SimpleNamespace(decoder=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight))),
    )


@given(
    t_min=st.floats(0.0, 2.0), span=st.floats(0.01, 2.0), steps=st.integers(1, 64),
)
@FEW
def test_temperature_is_transformers_schedule(t_min: float, span: float, steps: int) -> None:
    s = CanvasSettings(t_min=t_min, t_max=t_min + span, max_denoising_steps=steps)
    processor = LinearTemperatureScheduleLogitsProcessor(s.t_min, s.t_max, steps)
    logits = _logits(0, (3, 7), 5.0, ties=False)
    for n in range(steps, 0, -1):
        temp = temperature(torch.tensor(n), s)
        hf = processor(None, logits, cur_step=torch.tensor(n, dtype=torch.int32))
        assert temp.dtype == torch.float32 and temp.shape == ()
        assert torch.equal(logits / temp, hf)
        assert temp.item() == pytest.approx(s.t_min + span * n / steps, rel=1e-6)
    assert temperature(steps, s).item() == pytest.approx(s.t_max, rel=1e-6)


def test_checkpoint_schedule_values() -> None:
    s = CanvasSettings()
    values = [temperature(n, s).item() for n in (48, 24, 1)]
    assert values == pytest.approx([0.8, 0.6, 0.4 + 0.4 / 48], rel=1e-6)


@given(
    rows=st.integers(1, 3), canvas=st.integers(1, 64), vocab=st.integers(2, 40),
    scale=st.floats(0.05, 40.0), bound=st.floats(0.01, 3.0), ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
@FEW
def test_acceptance_is_entropy_bound_sampler(
    rows: int, canvas: int, vocab: int, scale: float, bound: float, ties: bool, seed: int
) -> None:
    logits = _logits(seed, (rows, canvas, vocab), scale, ties)
    entropy = token_entropy(logits)
    hf_entropy = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(entropy, hf_entropy)
    s = CanvasSettings(canvas_length=canvas, entropy_bound=bound)
    sampler, _, _ = _hf_parts(s, vocab)
    current = torch.zeros(rows, canvas, dtype=torch.long)
    sampler.accept_canvas(current, current + 1, logits, cur_step=1)
    accepted = accept_mask(entropy, bound)
    assert torch.equal(accepted, sampler.accepted_token_mask)
    lowest = entropy == entropy.min(dim=-1, keepdim=True).values  # [B, C]
    assert (accepted & lowest).any(dim=-1).all()  # a lowest-entropy position is always in


def test_acceptance_counts_on_known_entropies() -> None:
    entropy = torch.tensor([0.30, 0.01, 0.05, 0.02, 0.9])
    # ascending 0.01, 0.02, 0.05, 0.30, 0.90; sums before each: 0, .01, .03, .08, .38
    assert accept_mask(entropy, 0.1).tolist() == [True, True, True, True, False]
    assert accept_mask(entropy, 0.02).tolist() == [False, True, False, True, False]
    assert accept_mask(entropy, 1e-9).tolist() == [False, True, False, False, False]
    # the sum before rank 1 is (0.1 + e) - e in fp32: 0.10000002 for e = 0.7, 0.0999999 for 3
    assert accept_mask(torch.tensor([0.1, 0.7]), 0.1).tolist() == [True, False]
    assert accept_mask(torch.tensor([0.1, 3.0]), 0.1).tolist() == [True, True]


@given(
    rows=st.integers(1, 3), canvas=st.integers(1, 64), vocab=st.integers(2, 40),
    scale=st.floats(0.05, 20.0), seed=st.integers(0, 2**16),
)
@FEW
def test_samples_are_multinomial_draws(
    rows: int, canvas: int, vocab: int, scale: float, seed: int
) -> None:
    logits = _logits(seed, (rows, canvas, vocab), scale, ties=False)
    temp = torch.tensor(0.7)
    torch.manual_seed(seed)
    probs = torch.softmax(logits / temp, dim=-1, dtype=torch.float32)
    hf = torch.multinomial(probs.view(-1, vocab), num_samples=1).view(rows, canvas)
    hf_renoise = torch.randint(0, vocab, (rows, canvas))
    gen = torch.Generator().manual_seed(seed)
    noise = draw_step_noise((rows, canvas), vocab, gen, "cpu")
    proposal = propose(logits, temp, noise.exponential)
    assert torch.equal(proposal.sample, hf)
    assert torch.equal(noise.renoise_ids, hf_renoise)
    assert torch.equal(gen.get_state(), torch.get_rng_state())
    assert torch.equal(proposal.argmax, logits.argmax(-1))


def _steps_agree(
    rows: int, canvas: int, vocab: int, steps: int, s: CanvasSettings, seed: int,
    logits_seq: list[torch.Tensor], stopped_rows: list[bool],
) -> int:
    """Run `steps` steps of transformers' `_denoising_step` and of `canvas_step` /
    `canvas_step_reference` on the same logits and seed; assert every output agrees. Rows in
    `stopped_rows` start stopped (frozen). Returns how many rows stopped."""
    sampler, processors, stopping = _hf_parts(s, vocab)
    first = torch.randint(0, vocab, (rows, canvas), generator=torch.Generator().manual_seed(seed))
    finished = torch.tensor(stopped_rows)
    # transformers freezes a stopped row's self-conditioning logits: give them some to keep
    sc = _logits(seed, (rows, canvas, vocab), 1.0, False).bfloat16() if any(stopped_rows) else None
    hf_canvas, hf_argmax, hf_sc = first, first, sc
    torch.manual_seed(seed)
    fast_gen = torch.Generator().manual_seed(seed)
    ref_gen = torch.Generator().manual_seed(seed)
    fast = initial_state(first, s)._replace(stopped=finished.clone())
    ref = fast
    fast_sc = sc
    for k, n in enumerate(range(s.max_denoising_steps, s.max_denoising_steps - steps, -1)):
        hf_canvas, hf_argmax, hf_sc, finished = DiffusionGemmaGenerationMixin._denoising_step(
            _fake_model(vocab), lambda k=k, **_: SimpleNamespace(logits=logits_seq[k]),
            hf_canvas, hf_argmax, None, None, hf_sc, None, None, finished.clone(), n,
            sampler, processors, stopping,
        )
        noise = draw_step_noise((rows, canvas), vocab, fast_gen, "cpu")
        step = canvas_step(logits_seq[k], fast, torch.tensor(n), noise, s)
        fast_sc = self_conditioning_input(step.tempered, fast_sc, fast.stopped, torch.bfloat16)
        fast = step.state
        ref = canvas_step_reference(logits_seq[k], ref, n, ref_gen, s).state
        for got in (fast, ref):
            assert torch.equal(got.canvas, hf_canvas)
            assert torch.equal(got.argmax, hf_argmax)
            assert torch.equal(got.stopped, finished)
        assert torch.equal(fast_sc, hf_sc)
    assert torch.equal(fast_gen.get_state(), torch.get_rng_state())
    assert torch.equal(ref_gen.get_state(), torch.get_rng_state())
    return int(finished.sum())


@given(
    rows=st.integers(1, 3), canvas=st.integers(1, 64), vocab=st.integers(2, 33),
    steps=st.integers(1, 4), scale=st.floats(0.05, 40.0), bound=st.floats(0.01, 2.0),
    stability=st.integers(0, 2), ties=st.booleans(), seed=st.integers(0, 2**16),
    data=st.data(),
)
@FEW
def test_steps_equal_transformers_denoising_step(
    rows: int, canvas: int, vocab: int, steps: int, scale: float, bound: float,
    stability: int, ties: bool, seed: int, data: st.DataObject,
) -> None:
    s = CanvasSettings(
        canvas_length=canvas, max_denoising_steps=6, entropy_bound=bound,
        stability_threshold=stability, confidence_threshold=0.5,
    )
    logits_seq = [_logits(seed + k, (rows, canvas, vocab), scale, ties) for k in range(steps)]
    stopped_rows = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    _steps_agree(rows, canvas, vocab, steps, s, seed, logits_seq, stopped_rows)


def test_steps_stop_one_row_and_freeze_it() -> None:
    """Row 0 sharp and fixed (stops at step 2), row 1 flat: the batch keeps stepping."""
    rows, canvas, vocab = 2, 16, 24
    sharp = torch.full((canvas, vocab), -30.0).scatter_(1, torch.arange(canvas)[:, None] % 5, 30.0)
    logits_seq = []
    for k in range(4):
        flat = _logits(k, (canvas, vocab), 0.5, ties=False)
        logits_seq.append(torch.stack([sharp, flat]))
    s = CanvasSettings(canvas_length=canvas, max_denoising_steps=8)
    assert _steps_agree(rows, canvas, vocab, 4, s, 11, logits_seq, [False, False]) == 1


def _stop_steps(entropy_seq: list, argmax_seq: list, logits_seq: list, s: CanvasSettings):
    """The first step (1-based) at which transformers' criterion and `stop_test` say stop."""
    hf = StableAndConfidentStoppingCriteria(s.stability_threshold, s.confidence_threshold)
    history = initial_state(argmax_seq[0], s).history
    hf_at = ours_at = None
    for k, (entropy, argmax, logits) in enumerate(
        zip(entropy_seq, argmax_seq, logits_seq, strict=True)
    ):
        stop, history = stop_test(argmax, entropy, history, s)
        if bool(stop) and ours_at is None:
            ours_at = k + 1
        if bool(hf(argmax[None], logits[None])[0]) and hf_at is None:
            hf_at = k + 1
    return hf_at, ours_at


@pytest.mark.parametrize(
    ("case", "stability", "expected"),
    [
        ("stable_not_confident", 1, None),
        ("confident_not_stable", 1, None),
        ("confident_not_stable", 0, 1),
        ("both_from_step_3", 0, 3),
        ("both_from_step_3", 1, 4),
        ("both_from_step_3", 2, 5),
        ("both_from_step_3", 3, 6),
    ],
)
def test_stop_step_on_constructed_sequences(case: str, stability: int, expected: int) -> None:
    canvas, vocab, length = 12, 10, 8
    positions = torch.arange(canvas)[:, None]
    s = CanvasSettings(canvas_length=canvas, stability_threshold=stability)
    logits_seq = []
    for k in range(length):
        if case == "stable_not_confident":  # same argmax, mean entropy ~ 1 nat
            logits = torch.zeros(canvas, vocab).scatter_(1, positions % vocab, 2.0)
        elif case == "confident_not_stable":  # entropy ~ 0, argmax shifts every step
            logits = torch.full((canvas, vocab), -30.0).scatter_(1, (positions + k) % vocab, 30.0)
        elif k < 2:  # both: flat and moving for steps 1-2, then sharp at fixed ids
            ids = (positions + k + 1) % vocab
            logits = torch.full((canvas, vocab), -0.5).scatter_(1, ids, 0.5)
        else:
            logits = torch.full((canvas, vocab), -30.0).scatter_(1, positions % vocab, 30.0)
        logits_seq.append(logits)
    entropy_seq = [token_entropy(x) for x in logits_seq]
    argmax_seq = [x.argmax(-1) for x in logits_seq]
    hf_at, ours_at = _stop_steps(entropy_seq, argmax_seq, logits_seq, s)
    assert ours_at == hf_at == expected


@given(
    rows=st.integers(1, 4), canvas=st.integers(1, 64), seed=st.integers(0, 2**16),
    data=st.data(),
)
@FEW
def test_finish_canvas_is_transformers_finalize(
    rows: int, canvas: int, seed: int, data: st.DataObject
) -> None:
    s = CanvasSettings(canvas_length=canvas, eos_token_ids=(1, 106, 50), pad_token_id=0)
    gen = torch.Generator().manual_seed(seed)
    eos_rate = data.draw(st.floats(0.0, 0.3))
    argmax = torch.randint(200, 210, (rows, canvas), generator=gen)  # [B, C], no EOS
    eos = torch.tensor([1, 106, 50])[torch.randint(0, 3, (rows, canvas), generator=gen)]
    argmax = torch.where(torch.rand(rows, canvas, generator=gen) < eos_rate, eos, argmax)
    before = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    prompt = torch.full((rows, 3), 7)
    hf_ids, hf_finished = DiffusionGemmaGenerationMixin._finalize_canvas(
        torch.cat([prompt, argmax], dim=-1), before.clone(),
        SimpleNamespace(pad_token_id=0, eos_token_id=[1, 106, 50]),
        StoppingCriteriaList([EosTokenCriteria([1, 106, 50])]), canvas,
        torch.tensor([1, 106, 50]),
    )
    tokens, finished = finish_canvas(argmax, before, s)
    assert torch.equal(tokens, hf_ids[:, 3:])
    assert torch.equal(finished, hf_finished)


def test_finish_canvas_keeps_the_first_eos() -> None:
    s = CanvasSettings(canvas_length=6, eos_token_ids=(1, 106), pad_token_id=0)
    argmax = torch.tensor([[5, 106, 7, 1, 8, 9], [5, 6, 7, 8, 9, 4], [3, 3, 3, 3, 3, 3]])
    tokens, finished = finish_canvas(argmax, torch.tensor([False, False, True]), s)
    assert tokens.tolist() == [[5, 106, 0, 0, 0, 0], [5, 6, 7, 8, 9, 4], [0] * 6]
    assert finished.tolist() == [True, False, True]
    none = CanvasSettings(canvas_length=6, eos_token_ids=())
    tokens, finished = finish_canvas(argmax, torch.tensor([False, False, False]), none)
    assert torch.equal(tokens, argmax) and not finished.any()


def test_tokens_per_forward_is_transformers() -> None:
    generated = torch.tensor([[5, 106, 0, 0, 4, 4], [0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    forwards = torch.tensor([4, 3, 12], dtype=torch.int32)
    ours = tokens_per_forward(generated, forwards, 0)
    prompt = torch.full((3, 2), 9)
    hf = DiffusionGemmaGenerationMixin._compute_tokens_per_forward(
        torch.cat([prompt, generated], dim=-1), forwards, 2, 0
    )
    assert torch.equal(ours, hf)
    assert ours.tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_compiled_step_equals_eager(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    rows, canvas, vocab = 2, 8, 32
    s = CanvasSettings(canvas_length=canvas, max_denoising_steps=6, confidence_threshold=0.5)
    gen = torch.Generator().manual_seed(5)
    state = initial_state(torch.randint(0, vocab, (rows, canvas), generator=gen), s)
    state = state._replace(stopped=torch.tensor([False, True]))
    logits = _logits(5, (rows, canvas, vocab), 8.0, ties=False)
    noise = draw_step_noise((rows, canvas), vocab, gen, "cpu")
    compiled = torch.compile(canvas_step, fullgraph=True)
    for n in (6, 1):  # one graph for every n: it is a tensor
        eager = canvas_step(logits, state, torch.tensor(n), noise, s)
        with torch._dynamo.config.patch(error_on_recompile=n == 1):
            graph = compiled(logits, state, torch.tensor(n), noise, s)
        for got, want in zip(graph.state, eager.state, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(graph.accepted, eager.accepted)
        torch.testing.assert_close(graph.tempered, eager.tempered)
        torch.testing.assert_close(graph.entropy, eager.entropy)
    assert eager.accepted.any() and not eager.accepted.all()
