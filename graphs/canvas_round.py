"""DiffusionGemma's denoising step and encoder chunk as pure functions over static buffers.

`canvas_round` = the decoder forward of the canvas in `CanvasBuffers` against the cache (never
written) -> the step's random draws (`dlmc::canvas_step_noise`, from the default generator of
the device) -> `canvas_step` (temperature, sample, entropy-bound acceptance, re-noise, freeze,
stopping test) -> the next step's self-conditioning input. The buffers are updated in place and
nothing syncs with the host, so the same function runs eager, compiled (Inductor, fullgraph) or
replayed as a CUDA graph; given the same generator state, all three draw the same numbers.
`encode_chunk` is the encoder pass of a chunk of clean tokens: it writes their K/V and moves
the cache's device-side length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dlmc.custom_ops.canvas_noise import canvas_step_noise
from dlmc.custom_ops.canvas_propose import canvas_propose
from dlmc.graphs.canvas_rules import (
    CanvasState,
    Proposal,
    StepNoise,
    canvas_step,
    initial_state,
    self_conditioning_input,
    settle,
    temperature,
)
from dlmc.graphs.canvas_settings import CanvasSettings
from dlmc.kv.gemma_round_attention import CanvasRoundAttention, EncodeRoundAttention
from dlmc.kv.gemma_static_cache import GemmaStaticCache

__all__ = ["CanvasBuffers", "canvas_round", "encode_chunk"]


@dataclass
class CanvasBuffers:
    """Static device state of the canvas being denoised (allocated once per runner)."""

    tokens: torch.Tensor  # [C] int64: the decoder's next input (accepted samples + noise)
    positions: torch.Tensor  # [C] int64: absolute positions (continuing after the cache)
    argmax: torch.Tensor  # [C] int64: the latest argmax canvas (what is appended)
    history: torch.Tensor  # [S, C] int64: the last S argmax canvases, -1 before any
    accepted: torch.Tensor  # [C] bool: positions that kept their sample in the last step
    entropy: torch.Tensor  # [C] fp32: the last step's entropy per position (nats)
    stopped: torch.Tensor  # [] bool: stable and confident at some step
    done: torch.Tensor  # [] bool: stopped, or no denoising step left (the host's one read)
    steps_remaining: torch.Tensor  # [] int32: n of the next step (N .. 1)
    sc_logits: torch.Tensor  # [C, V] model dtype: the last step's tempered logits

    @classmethod
    def allocate(cls, settings: CanvasSettings, vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> CanvasBuffers:
        c, s = settings.canvas_length, settings.history_depth
        long, b = torch.int64, torch.bool
        return cls(
            tokens=torch.zeros(c, dtype=long, device=device),
            positions=torch.zeros(c, dtype=long, device=device),
            argmax=torch.zeros(c, dtype=long, device=device),
            history=torch.full((s, c), -1, dtype=long, device=device),
            accepted=torch.zeros(c, dtype=b, device=device),
            entropy=torch.zeros(c, dtype=torch.float32, device=device),
            stopped=torch.zeros((), dtype=b, device=device),
            done=torch.zeros((), dtype=b, device=device),
            steps_remaining=torch.zeros((), dtype=torch.int32, device=device),
            sc_logits=torch.zeros(c, vocab_size, dtype=dtype, device=device),
        )

    def start(self, canvas: torch.Tensor, start: int, settings: CanvasSettings) -> None:
        """Reset the state before step 1 of a canvas `canvas [C]` at positions `start ..`
        (`canvas_rules.initial_state`); `sc_logits` is not read by a first step."""
        state = initial_state(canvas.to(self.tokens.device), settings)
        self.tokens.copy_(state.canvas)
        self.argmax.copy_(state.argmax)
        self.history.copy_(state.history)
        self.stopped.copy_(state.stopped)
        self.positions.copy_(torch.arange(start, start + canvas.shape[0],
                                          device=self.positions.device))
        self.accepted.zero_()
        self.entropy.zero_()
        self.done.zero_()
        self.steps_remaining.fill_(settings.max_denoising_steps)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every buffer (`restore` puts them back)."""
        return {f.name: getattr(self, f.name).clone() for f in fields(self)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            getattr(self, name).copy_(value)


def canvas_round(
    model: torch.nn.Module,
    buf: CanvasBuffers,
    cache: GemmaStaticCache,
    key_len: int,
    settings: CanvasSettings,
    first: bool,
    triton_attention: bool = False,
    triton_sampler: bool = False,
) -> None:
    """One denoising step of the canvas in `buf` over `cache` (full layers' keys in the bucket
    `[0, key_len)`, key_len >= the cache length). `first`: the canvas's first step, whose
    decoder input has no self-conditioning (a Python bool: one compiled function per value).
    `triton_attention`: attend through `dlmc::paged_attention` (`CanvasRoundAttention`).
    `triton_sampler`: the proposal from `dlmc::canvas_propose`, which also writes the next
    self-conditioning input into `buf.sc_logits` and applies the final soft cap to the
    lm_head's output itself (else the model's capped fp32 logits and `canvas_step`'s torch
    ops).

    The step's n is `buf.steps_remaining` (held at 1 once it runs out, so a step run after the
    budget repeats the last temperature); `buf.done` = stopped or no step left after this one.
    """
    ctx = CanvasRoundAttention(cache, key_len, triton_attention)
    previous = None if first else buf.sc_logits
    logits = model(buf.tokens, buf.positions, ctx, decoder=True,
                   self_conditioning_logits=previous,
                   soft_cap=not triton_sampler)  # [C, V]: fp32, or before the cap
    noise = StepNoise(*canvas_step_noise(logits))  # ([C, V] fp32, [C] int64)
    n = buf.steps_remaining.clamp(min=1)  # [] int32
    state = CanvasState(buf.tokens, buf.argmax, buf.history, buf.stopped)
    if triton_sampler:  # rows stopped before the step keep their self-conditioning input
        temp = temperature(n, settings, logits.device)  # []
        sample, argmax, entropy = canvas_propose(
            logits, noise.exponential, temp, buf.sc_logits, None if first else buf.stopped,
            model.config.final_logit_softcapping)
        step = settle(Proposal(None, sample, argmax, entropy), state, noise, settings)
    else:
        step = canvas_step(logits, state, n, noise, settings)
        buf.sc_logits.copy_(self_conditioning_input(step.tempered, previous, buf.stopped,
                                                    buf.sc_logits.dtype))  # [C, V]
    left = n - 1  # [] int32
    buf.tokens.copy_(step.state.canvas)
    buf.argmax.copy_(step.state.argmax)
    buf.history.copy_(step.state.history)
    buf.accepted.copy_(step.accepted)
    buf.entropy.copy_(step.entropy)
    buf.stopped.copy_(step.state.stopped)
    buf.steps_remaining.copy_(left)
    buf.done.copy_(step.state.stopped | (left <= 0))


def encode_chunk(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: GemmaStaticCache,
    key_len: int,
    length: torch.Tensor,
    triton_attention: bool = False,
) -> None:
    """The encoder (causal) pass of `tokens [T]` at consecutive `positions [T]`: their K/V go to
    `cache`, whose length becomes `length` (int64 `[]`; a chunk padded at its end passes the
    length of its real tokens, so the padding's K/V, written past it, are never attended).
    `key_len` >= the chunk's last position + 1. `triton_attention`: through
    `dlmc::paged_attention_append` (`EncodeRoundAttention`)."""
    ctx = EncodeRoundAttention(cache, positions, key_len, triton_attention)
    model(tokens, positions, ctx, compute_logits=False)
    cache.length.copy_(length)
