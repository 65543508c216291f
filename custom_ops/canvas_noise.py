"""`dlmc::canvas_step_noise`: one DiffusionGemma denoising step's random draws, from the default
generator of the logits' device, in transformers' order.

The draws are an Exp(1) tensor shaped like the logits `[..., C, V]` (fp32; the categorical
sample is `argmax(softmax / noise)`, `torch.multinomial`'s own computation) and then the
re-noise ids `[..., C]` (int64, uniform in `[0, V)`): `empty.exponential_(1)` then
`torch.randint`, the aten calls that eager decoding makes. As an opaque op, a compiled step
calls exactly these aten kernels, in this order, whatever Inductor's options: Inductor would
otherwise replace them by its own generator (another stream) or, with `fallback_random`, may
schedule the two fallback draws in either order on older torch. On CUDA both kernels read the
default generator's philox seed and offset, which a CUDA graph registers at capture: each
replay draws what an eager call from the same generator state draws and advances the state as
much. The maths with an explicit generator is `canvas_step_noise_reference`.
"""

from __future__ import annotations

import torch

__all__ = ["canvas_step_noise", "canvas_step_noise_reference"]


def canvas_step_noise_reference(
    logits: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(exponential [..., C, V] fp32, renoise_ids [..., C] int64)` drawn from `generator` (None:
    the default generator of `logits`' device) for logits shaped `[..., C, V]`."""
    vocab_size = logits.shape[-1]
    exponential = torch.empty(logits.shape, dtype=torch.float32, device=logits.device
                              ).exponential_(1.0, generator=generator)  # [..., C, V]
    renoise_ids = torch.randint(0, vocab_size, tuple(logits.shape[:-1]), generator=generator,
                                device=logits.device)  # [..., C]
    return exponential, renoise_ids


def _canvas_step_noise_impl(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return canvas_step_noise_reference(logits, None)


def _canvas_step_noise_fake(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(logits.shape, dtype=torch.float32, device=logits.device),
            torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device))


# Tagged as a seeded random op: never constant-folded, deduplicated or reordered as a pure one.
_canvas_step_noise_op = torch.library.custom_op(
    "dlmc::canvas_step_noise", _canvas_step_noise_impl, mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,))
_canvas_step_noise_op.register_fake(_canvas_step_noise_fake)


def canvas_step_noise(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step's draws for logits `[..., C, V]` (any dtype; only the shape and the
    device are read): the Exp(1) noise `[..., C, V]` fp32, then the re-noise ids `[..., C]`
    int64 in `[0, V)`, from the default generator of the logits' device (what
    `canvas_step_noise_reference(logits, None)` draws, also when compiled or graph-replayed)."""
    return _canvas_step_noise_op(logits)
