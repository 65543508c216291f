"""DiffusionGemma's canvas decoding rules (transformers' `DiffusionGemmaGenerationMixin.generate`)
as sync-free tensor functions.

One denoising step takes the decoder's fp32 soft-capped logits `[..., C, V]` (C = canvas length,
leading dims = rows) and returns the next canvas, the argmax canvas and the stopping flag as
device tensors: no `.item()`, no branch on tensor values, fixed shapes, so a compiled,
CUDA-graph-captured step can call it. Randomness comes from an explicit `torch.Generator`
(`draw_initial_canvas`, `draw_step_noise`, `canvas_step_reference`) or from noise tensors
passed in (`canvas_step`), drawn before the step or inside the graph.

How transformers draws its random numbers
-----------------------------------------
`DiffusionGemmaGenerationMixin.generate` passes no generator: it draws from the default
generator of the canvas's device, which `torch.manual_seed(seed)` seeds (a
`torch.Generator(device).manual_seed(seed)` yields the same stream). For each canvas, in order:

1. Initial canvas (`_prepare_denoiser_inputs` -> `EntropyBoundSampler.initialize_canvas`):
   `torch.randint(0, V, (B, C))`, int64. It is drawn even when `decoder_input_ids` is given
   (the draw is the default argument of a `dict.pop`, evaluated first), so a given first
   canvas still advances the generator.
2. Every denoising step n = N .. 1 (`_denoising_step`), for the whole batch, rows that have
   stopped or finished included:
   a. `torch.multinomial(softmax(L / T).view(B * C, V), num_samples=1)`. For one sample torch
      computes `argmax(probs / q, -1)` with `q = torch.empty_like(probs).exponential_(1)`: one
      Exp(1) draw per vocabulary entry, `[B * C, V]` fp32 in row-major order, one call.
   b. `EntropyBoundSampler.renoise_canvas`: `torch.randint(0, V, (B, C))`, int64, for every
      position (the accepted ones are drawn and discarded).
   The temperature, entropies, acceptance and stopping test draw nothing. The canvas ends
   when every row has stopped, so the batch draws for the steps of its slowest row.
3. The encoder passes draw nothing.

Eager decoding is token-identical to transformers' with the same seed when it draws these
tensors, with these shapes and dtypes, in this order, from one generator: `draw_initial_canvas`
per canvas, then `draw_step_noise` (2a then 2b) per step. Another order changes the stream,
and so may drawing per row (on CUDA each call rounds the generator's offset up). The logits
must be identical too: a different kernel's last-bit difference can flip a sample. Only
transformers' eager path (its default dynamic cache) can be matched: with a static cache it
compiles `renoise_canvas`, whose randint becomes Inductor's own random op (another stream).

Exactness. Eagerly, `canvas_step` computes bit for bit what transformers does (tested on the
CPU): the temperature as a fp32 `[]` tensor `t_min + (t_max - t_min) * (n / N)` (fp32
arithmetic: `n` is an int32 tensor there), a true division of the logits by it,
`torch.softmax` for the sampling probabilities, `torch.distributions.Categorical`'s entropy
formula, the unstable `torch.sort` of the entropies and `cumsum - sorted <= bound`. Compiled,
Inductor may sum in another order, so an entropy at the bound (or a tie in the sort) can
fall the other way.

`canvas_step_reference` is the readable definition: transformers' own calls
(`torch.multinomial`, `Categorical`, `torch.randint`) with an explicit generator, eager only
(`torch.multinomial` checks its input on the host). `canvas_step` is the same step with the
draws passed in as `StepNoise`: sync-free, `torch.compile(fullgraph=True)`-able. With noise
from `draw_step_noise(generator)` both give identical outputs and leave the generator in the
same state. A compiled graph cannot take a `torch.Generator` argument, so it gets the noise as
an input buffer, or draws it inside with `draw_step_noise(generator=None)` (then from
Inductor's generator: valid samples, not transformers' stream).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from dlmc.graphs.canvas_settings import CanvasSettings

# (canvas [B, C] int64, self-conditioning logits [B, C, V] or None) -> fp32 logits [B, C, V]
Decoder = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class StepNoise(NamedTuple):
    """The random draws of one denoising step, in transformers' order."""

    exponential: torch.Tensor  # [..., C, V] fp32 Exp(1): the categorical sample's noise
    renoise_ids: torch.Tensor  # [..., C] int64 in [0, V): fresh ids for rejected positions


class CanvasState(NamedTuple):
    """What a canvas carries from one denoising step to the next (`initial_state`)."""

    canvas: torch.Tensor  # [..., C] int64: the decoder's next input
    argmax: torch.Tensor  # [..., C] int64: the latest argmax canvas (the canvas before step 1)
    history: torch.Tensor  # [S, ..., C] int64: the last S argmax canvases, -1 before any
    stopped: torch.Tensor  # [...] bool: stable and confident at some step so far


class CanvasStep(NamedTuple):
    """One step's result: the next state and the step's tensors the caller may need."""

    state: CanvasState
    tempered: torch.Tensor | None  # [..., C, V] fp32 logits / T (the next self-conditioning
    #                                 input; None as in `Proposal`)
    entropy: torch.Tensor  # [..., C] fp32 nats of softmax(tempered)
    accepted: torch.Tensor  # [..., C] bool: positions that keep their sample


def temperature(
    steps_remaining: torch.Tensor | int, settings: CanvasSettings,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`t_min + (t_max - t_min) * n / max_denoising_steps` for n = `steps_remaining` (N .. 1).

    fp32 `[]` on `device` (default: `steps_remaining`'s), computed as transformers does: n an
    int32 tensor on the logits' device, fp32 arithmetic there (CUDA divides by the Python
    scalar N as a multiplication by 1/N, CPU truly divides: the device matters to the last
    bit). Pass n as a device tensor so one captured step serves every n.
    """
    n = torch.as_tensor(steps_remaining, dtype=torch.int32, device=device)  # []
    span = settings.t_max - settings.t_min
    return settings.t_min + span * (n / settings.max_denoising_steps)  # [] fp32


def token_entropy(tempered: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of `softmax(tempered [..., V])` per row -> `[...]`, with
    `torch.distributions.Categorical(logits=tempered).entropy()`'s operations (bit-identical
    eagerly) and without its argument check (a host sync)."""
    log_p = tempered - tempered.logsumexp(dim=-1, keepdim=True)  # [..., V]
    p = torch.softmax(log_p, dim=-1)  # [..., V]
    log_p = torch.clamp(log_p, min=torch.finfo(log_p.dtype).min)  # -inf * 0 -> 0, not nan
    return -(log_p * p).sum(-1)  # [...]


class Proposal(NamedTuple):
    """One step's proposal for every canvas position."""

    tempered: torch.Tensor | None  # [..., C, V] fp32 logits / T (None: `dlmc::canvas_propose`
    #                                 wrote the self-conditioning input itself)
    sample: torch.Tensor  # [..., C] int64: one categorical sample of softmax(tempered)
    argmax: torch.Tensor  # [..., C] int64: argmax(tempered) = argmax(logits)
    entropy: torch.Tensor  # [..., C] fp32 nats


def propose(logits: torch.Tensor, temp: torch.Tensor, exponential: torch.Tensor) -> Proposal:
    """Proposal from fp32 soft-capped `logits [..., C, V]` at temperature `temp` (fp32 `[]`).

    The sample is `argmax(softmax(logits / temp) / exponential)` with `exponential [..., C, V]`
    Exp(1) noise: `torch.multinomial(probs, 1)`'s own computation, so noise from the generator
    that multinomial would use gives its sample.
    """
    tempered = logits / temp  # [..., C, V]
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)  # [..., C, V]
    sample = torch.argmax(probs / exponential, dim=-1)  # [..., C]
    argmax = torch.argmax(tempered, dim=-1)  # [..., C]
    return Proposal(tempered, sample, argmax, token_entropy(tempered))


def accept_mask(entropy: torch.Tensor, entropy_bound: float) -> torch.Tensor:
    """Entropy-bound acceptance over the last dim of `entropy [..., C]` -> bool `[..., C]`.

    Rank positions by ascending entropy; rank k is accepted iff the sum of the entropies of
    ranks < k is <= `entropy_bound` (so rank 0 always is). As transformers computes it: the
    unstable `torch.sort`, and that sum as `cumsum - own entropy`, whose rounding decides at the
    bound.
    """
    ranked, order = torch.sort(entropy, dim=-1, descending=False)  # [..., C] each
    before = torch.cumsum(ranked, dim=-1) - ranked  # [..., C]
    accepted_ranked = before <= entropy_bound  # [..., C]
    return torch.scatter(torch.zeros_like(accepted_ranked), -1, order, accepted_ranked)


def renoise(
    sample: torch.Tensor, accepted: torch.Tensor, renoise_ids: torch.Tensor
) -> torch.Tensor:
    """Next canvas `[..., C]`: the sample where accepted, a fresh random id everywhere else
    (nothing is frozen: a position accepted before is re-noised once it drops out)."""
    return torch.where(accepted, sample, renoise_ids)


def stop_test(
    argmax: torch.Tensor, entropy: torch.Tensor, history: torch.Tensor, settings: CanvasSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(stop [...] bool, history [S, ..., C])` after a step with argmax canvas `argmax [..., C]`.

    Stable: `argmax` equals each of the last S = `history_depth` argmax canvases in
    `history` (S = 0: always; the history starts at -1, so the first step never is).
    Confident: the mean over the canvas of `entropy [..., C]` (tempered logits) is below
    `confidence_threshold`. The new history drops the oldest canvas and appends `argmax`.
    """
    stable = (history == argmax[None]).all(dim=-1).all(dim=0)  # [...]
    confident = entropy.mean(dim=-1) < settings.confidence_threshold  # [...]
    if settings.history_depth > 0:
        history = torch.cat([history[1:], argmax[None]])  # [S, ..., C]
    return stable & confident, history


def initial_state(canvas: torch.Tensor, settings: CanvasSettings) -> CanvasState:
    """The state before step 1 of a canvas that starts as `canvas [..., C]` int64."""
    history = torch.full(
        (settings.history_depth, *canvas.shape), -1, dtype=canvas.dtype, device=canvas.device
    )  # [S, ..., C]
    stopped = torch.zeros(canvas.shape[:-1], dtype=torch.bool, device=canvas.device)  # [...]
    return CanvasState(canvas, canvas, history, stopped)


def draw_initial_canvas(
    shape: tuple[int, ...], vocab_size: int, generator: torch.Generator | None,
    device: torch.device | str,
) -> torch.Tensor:
    """A canvas of uniform random ids, int64 `shape` (`(B, C)` for transformers' parity)."""
    return torch.randint(0, vocab_size, shape, generator=generator, device=device)


def draw_step_noise(
    shape: tuple[int, ...], vocab_size: int, generator: torch.Generator | None,
    device: torch.device | str,
) -> StepNoise:
    """One step's draws for canvases of `shape` (`(..., C)`), in transformers' order: the
    Exp(1) noise of the categorical samples `[..., C, V]` fp32, then the re-noise ids."""
    exponential = torch.empty(
        (*shape, vocab_size), dtype=torch.float32, device=device
    ).exponential_(1.0, generator=generator)  # [..., C, V]
    renoise_ids = torch.randint(0, vocab_size, shape, generator=generator, device=device)
    return StepNoise(exponential, renoise_ids)


def _close_step(
    state: CanvasState, proposal: Proposal, accepted: torch.Tensor, canvas: torch.Tensor,
    settings: CanvasSettings,
) -> CanvasStep:
    """Rows stopped before this step keep their canvas and argmax; then the stopping test."""
    frozen = state.stopped[..., None]  # [..., 1]
    canvas = torch.where(frozen, state.canvas, canvas)  # [..., C]
    argmax = torch.where(frozen, state.argmax, proposal.argmax)  # [..., C]
    stop, history = stop_test(argmax, proposal.entropy, state.history, settings)
    next_state = CanvasState(canvas, argmax, history, state.stopped | stop)
    return CanvasStep(next_state, proposal.tempered, proposal.entropy, accepted)


def canvas_step(
    logits: torch.Tensor,
    state: CanvasState,
    steps_remaining: torch.Tensor | int,
    noise: StepNoise,
    settings: CanvasSettings,
) -> CanvasStep:
    """One denoising step from fp32 soft-capped `logits [..., C, V]`, sync-free.

    `steps_remaining`: n (N .. 1), best an integer device tensor `[]`; `noise`: this step's
    draws (`draw_step_noise`). Temper, sample, accept by entropy, re-noise, freeze the rows
    stopped before, stopping test. The caller keeps the self-conditioning input of rows that
    had stopped (`self_conditioning_input`).
    """
    temp = temperature(steps_remaining, settings, logits.device)  # []
    return settle(propose(logits, temp, noise.exponential), state, noise, settings)


def settle(proposal: Proposal, state: CanvasState, noise: StepNoise, settings: CanvasSettings
           ) -> CanvasStep:
    """The rest of `canvas_step` after its proposal: accept by entropy, re-noise, freeze the
    rows stopped before, stopping test."""
    accepted = accept_mask(proposal.entropy, settings.entropy_bound)  # [..., C]
    canvas = renoise(proposal.sample, accepted, noise.renoise_ids)  # [..., C]
    return _close_step(state, proposal, accepted, canvas, settings)


def canvas_step_reference(
    logits: torch.Tensor,
    state: CanvasState,
    steps_remaining: int,
    generator: torch.Generator | None,
    settings: CanvasSettings,
) -> CanvasStep:
    """`canvas_step` written with transformers' calls, drawing from `generator` (eager only)."""
    temp = temperature(steps_remaining, settings, logits.device)  # []
    tempered = logits / temp  # [..., C, V]
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)  # [..., C, V]
    vocab_size = probs.shape[-1]
    sample = torch.multinomial(probs.reshape(-1, vocab_size), 1, generator=generator)
    sample = sample.view(state.canvas.shape)  # [..., C]
    argmax = torch.argmax(tempered, dim=-1)  # [..., C]
    entropy = torch.distributions.Categorical(logits=tempered).entropy()  # [..., C]
    accepted = accept_mask(entropy, settings.entropy_bound)  # [..., C]
    kept = torch.where(accepted, sample, state.canvas)  # [..., C]
    fresh = torch.randint(
        0, vocab_size, tuple(state.canvas.shape), generator=generator, device=logits.device
    )  # [..., C]
    canvas = torch.where(~accepted, fresh, kept)  # [..., C]
    proposal = Proposal(tempered, sample, argmax, entropy)
    return _close_step(state, proposal, accepted, canvas, settings)


def self_conditioning_input(
    tempered: torch.Tensor, previous: torch.Tensor | None, stopped: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The decoder's next self-conditioning logits `[..., C, V]` in `dtype` (the embedding's):
    this step's tempered logits, or `previous` for rows that had stopped before the step
    (`stopped [...]` as it was before it)."""
    if previous is None:  # the first step of a canvas: no row has stopped
        return tempered.to(dtype)
    return torch.where(stopped[..., None, None], previous, tempered).to(dtype)


def count_decoder_forward(
    decoder_forwards: torch.Tensor, stopped: torch.Tensor, finished: torch.Tensor
) -> torch.Tensor:
    """Decoder forwards per row `[B]` before a step: +1 for a row that has neither stopped in
    this canvas (`stopped [B]`) nor finished in an earlier one (`finished [B]`)."""
    return decoder_forwards + ~(stopped | finished)


def _is_eos(tokens: torch.Tensor, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Bool mask of `tokens` equal to an EOS id: compares with Python ints, so no id tensor is
    copied to the device (not allowed while a CUDA graph captures)."""
    is_eos = torch.zeros_like(tokens, dtype=torch.bool)
    for eos in eos_token_ids:
        is_eos = is_eos | (tokens == eos)
    return is_eos


def finish_canvas(
    argmax: torch.Tensor, finished: torch.Tensor, settings: CanvasSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """EOS rules for the argmax canvas `argmax [..., C]` appended to rows finished before it
    or not (`finished [...]` bool) -> `(tokens [..., C], finished [...])`.

    A row finished before gets the whole canvas as pad. Otherwise the first EOS id stays,
    every token after it becomes pad, and the row is finished if the canvas holds an EOS.
    """
    pad = settings.pad_token_id
    tokens = torch.where(finished[..., None], pad, argmax)  # [..., C]
    is_eos = _is_eos(tokens, settings.eos_token_ids)  # [..., C]
    seen = is_eos.cumsum(dim=-1)  # [..., C] EOS ids up to and including each position
    after_first = (seen > 0) & ~((seen == 1) & is_eos)  # [..., C]
    tokens = torch.where(after_first, pad, tokens)  # [..., C]
    return tokens, finished | _is_eos(argmax, settings.eos_token_ids).any(dim=-1)


def tokens_per_forward(
    generated: torch.Tensor, decoder_forwards: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """Tokens per decoder forward per row, as transformers reports it: the non-pad ids in the
    appended canvases `generated [B, N]` over the row's decoder forwards `[B]` (encoder passes
    not counted) -> fp32 `[B]`."""
    return (generated != pad_token_id).sum(dim=-1) / decoder_forwards


def denoise_canvas_reference(
    decoder: Decoder,
    settings: CanvasSettings,
    vocab_size: int,
    generator: torch.Generator | None,
    finished: torch.Tensor,
    decoder_forwards: torch.Tensor,
    self_conditioning_dtype: torch.dtype,
    first_canvas: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise one canvas for `B` rows eagerly, drawing as transformers' `generate` does.

    `decoder` runs the model on the canvas; `finished [B]`: rows done in earlier canvases;
    `first_canvas [B, C]` replaces the random initial canvas (which is drawn all the same).
    Returns the argmax canvas `[B, C]` (to append; `finish_canvas` applies the EOS rules) and
    the decoder forwards per row, counted on from `decoder_forwards [B]`. Stops when every
    row is stable and confident, checked on the host once per step.
    """
    shape = (finished.shape[0], settings.canvas_length)
    drawn = draw_initial_canvas(shape, vocab_size, generator, finished.device)  # [B, C]
    state = initial_state(drawn if first_canvas is None else first_canvas, settings)
    self_conditioning = None
    for steps_remaining in range(settings.max_denoising_steps, 0, -1):
        decoder_forwards = count_decoder_forward(decoder_forwards, state.stopped, finished)
        logits = decoder(state.canvas, self_conditioning)  # [B, C, V]
        noise = draw_step_noise(shape, vocab_size, generator, finished.device)
        step = canvas_step(logits, state, steps_remaining, noise, settings)
        self_conditioning = self_conditioning_input(
            step.tempered, self_conditioning, state.stopped, self_conditioning_dtype
        )
        state = step.state
        if bool(state.stopped.all()):  # the loop's one host sync per step
            break
    return state.argmax, decoder_forwards
