"""DiffusionGemma's canvas decoder: block-autoregressive canvases, each denoised from uniform
noise by the entropy-bound sampler (transformers' `DiffusionGemmaGenerationMixin.generate`).

Per request: encode the prompt (causal, in chunks of `prefill_chunk` tokens) into the KV cache.
Per canvas: draw a uniform-random canvas; run denoising steps n = N .. 1 (decoder forward over
[cache ; canvas], temperature `t_min + (t_max - t_min) n / N`, sample and argmax, accept the
lowest-entropy positions within the entropy bound, re-noise the rest) until the argmax is
stable and the mean entropy under the confidence threshold, or N steps; append the argmax
canvas, cut at its first EOS. Stop at EOS or after `ceil(max_new_tokens / C)` canvases (so the
answer may pass `max_new_tokens` by up to C - 1 tokens, as transformers' does), else encode the
appended canvas and start the next.

Random numbers come from one generator seeded by the request (`cfg.seed`; None: a fresh seed),
drawn in transformers' order (the initial canvas, then per step the sample's noise and the
re-noise ids). What each mode guarantees for a request with seed s:

- "eager" and "reference" give the tokens of `torch.manual_seed(s); model.generate(...)` in
  transformers' eager mode: the same draws, and every step's acceptance decisions (tested on
  tiny random models in fp32 on the CPU). A prompt longer than
  `prefill_chunk` is encoded in chunks, which transformers encodes in one pass: the same logits
  to rounding, so a near-tie may sample differently.
- "compile" and "graph" draw the same numbers from the same generator state (swapped into the
  device's default generator for each step, which is left as it was), and take each step's
  decisions from logits equal to eager's to fp32 rounding (Inductor's fusion, key-length
  buckets, padded encoder chunks): the same tokens as "eager" unless a sample or an entropy
  falls within that rounding of a tie, which the self-conditioning of later steps amplifies
  (on the tiny fp32 model they are token-identical). "graph" replays "compile"'s kernels:
  identical to it.

How each pass runs is the stepper's (`dlmc.engine.canvas_steppers`, by `mode`). The host
reads one flag per step (the canvas's stop), plus the events' tensors when `rounds` is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from dlmc.custom_ops.kernel_config import DEFAULT_KERNELS, KernelConfig
from dlmc.engine.canvas_config import CanvasDecodeConfig
from dlmc.engine.canvas_steppers import CanvasStepper, make_stepper
from dlmc.engine.events import BlockEvent, CanvasRoundEvent, DecodeOutput
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_rules import CanvasStep, draw_initial_canvas, finish_canvas
from dlmc.kv.scales import KVScales
from dlmc.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from dlmc.models.diffusion_gemma_attention import CausalContext

Event = CanvasRoundEvent | BlockEvent
PREFILL_CHUNK = 1024


class CanvasDecoder:
    """Runs one request at a time on `model` with the stepper of `mode` ("graph", "compile",
    "eager" or "reference"; `canvas_steppers.MODES`).

    `max_context`: positions the prompt and the canvases may take in all. `prefill_chunk`:
    prompt tokens per encoder pass. `kernels`: the kernel choices, handed to the stepper.
    `fp8_scales`: the cache holds FP8 K/V with these per-layer scales (None: the activation
    dtype); the canvas's own K/V stay in the activation dtype.
    """

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device,
                 mode: str = "eager", max_context: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK,
                 kernels: KernelConfig = DEFAULT_KERNELS,
                 fp8_scales: KVScales | None = None) -> None:
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk={prefill_chunk!r}: expected an integer >= 1")
        self.model, self.device, self.mode = model, device, mode
        self.max_context = max_context or model.config.max_position_embeddings
        self.prefill_chunk, self.kernels = prefill_chunk, kernels
        self.fp8_scales = fp8_scales
        # the cached stepper now (an unknown mode fails here); the uncached one on first use
        self._steppers = {True: make_stepper(mode, model, device, True, kernels, fp8_scales)}

    def stepper(self, use_cache: bool) -> CanvasStepper:
        if use_cache not in self._steppers:
            self._steppers[use_cache] = make_stepper(self.mode, self.model, self.device,
                                                     use_cache, self.kernels, self.fp8_scales)
        return self._steppers[use_cache]

    def decode(
        self, prompt_ids: list[int], cfg: CanvasDecodeConfig, use_cache: bool = True,
        rounds: bool = False, cancel: Callable[[], bool] | None = None,
    ) -> Generator[Event, None, DecodeOutput]:
        """Yield a CanvasRoundEvent per step (if `rounds`) and a BlockEvent per appended
        canvas; return the DecodeOutput (tokens per forward as transformers counts it)."""
        s = cfg.settings
        length, plen = s.canvas_length, len(prompt_ids)
        self._check_prompt(prompt_ids, s.canvas_count * length)
        stepper = self.stepper(use_cache)
        generator = torch.Generator(device=self.device)
        if cfg.seed is None:
            generator.seed()
        else:
            generator.manual_seed(cfg.seed)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)  # [P]
        stepper.reset(s, plen + (s.canvas_count - 1) * length)
        total = self._encode(stepper, prompt, 0)
        finished = torch.zeros(1, dtype=torch.bool, device=self.device)  # [1]
        answer: list[int] = []
        forwards, finish, canvas_index = 0, "length", 0
        appended: torch.Tensor | None = None
        with torch.inference_mode():
            for canvas_index in range(s.canvas_count):
                start = plen + canvas_index * length
                if appended is not None:  # the last canvas is never encoded
                    if cancel is not None and cancel():  # before the encoder's pass
                        finish = "cancelled"
                        break
                    total += self._encode(stepper, appended, start - length)
                drawn = draw_initial_canvas((1, length), self.model.config.vocab_size,
                                            generator, self.device)  # [1, C]
                stepper.begin_canvas(drawn, start)
                step: CanvasStep | None = None
                steps = 0
                for n in range(s.max_denoising_steps, 0, -1):
                    if cancel is not None and cancel():
                        finish = "cancelled"
                        break
                    step = stepper.step(n, generator)
                    steps += 1
                    stopped = bool(step.state.stopped.all())  # the one host read per step
                    if rounds:
                        yield self._round_event(step, canvas_index, steps, n, stopped)
                    if stopped:
                        break
                forwards += steps
                if finish == "cancelled" or step is None:
                    break
                tokens, finished = finish_canvas(step.state.argmax, finished, s)  # [1, C]
                appended = tokens[0]
                new_ids = appended.tolist()
                eos = [i for i, t in enumerate(new_ids) if t in s.eos_token_ids]
                if eos:
                    new_ids = new_ids[: eos[0] + 1]
                answer.extend(new_ids)
                yield BlockEvent(canvas_index, tuple(new_ids), steps)
                if bool(finished.all()):
                    finish = "stop"
                    break
        counted = sum(t != s.pad_token_id for t in answer)
        tpf = counted / forwards if forwards else 0.0
        canvases = canvas_index + (finish != "cancelled")
        return DecodeOutput(tuple(answer), finish, forwards, forwards + total, canvases,
                            tokens_per_forward=tpf)

    def _check_prompt(self, prompt_ids: list[int], generated: int) -> None:
        config = self.model.config
        if not prompt_ids:
            raise ConfigError("prompt: expected at least one token")
        images = sorted(set(prompt_ids) & set(config.image_token_ids))
        if images:
            raise ConfigError(
                f"prompt: id {images[0]} is an image placeholder; dlmc runs DiffusionGemma's "
                "text path only (the vision tower is not loaded), so requests with images are "
                "not supported")
        if len(prompt_ids) + generated > self.max_context:
            raise ConfigError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens rounded up to whole "
                f"canvases ({generated}) = {len(prompt_ids) + generated} tokens exceeds the "
                f"model's context of {self.max_context}")

    def _encode(self, stepper: CanvasStepper, token_ids: torch.Tensor, start: int) -> int:
        """Encoder passes over `token_ids` at `start ..`, `prefill_chunk` tokens each; returns
        how many ran."""
        count = 0
        with torch.inference_mode():
            for offset in range(0, token_ids.shape[0], self.prefill_chunk):
                stepper.encode(token_ids[offset: offset + self.prefill_chunk], start + offset)
                count += 1
        return count

    @staticmethod
    def _round_event(step: CanvasStep, canvas_index: int, index: int, steps_remaining: int,
                     stopped: bool) -> CanvasRoundEvent:
        return CanvasRoundEvent(
            canvas_index, index, steps_remaining, tuple(step.state.canvas[0].tolist()),
            tuple(step.accepted[0].tolist()), tuple(step.state.argmax[0].tolist()),
            float(step.entropy[0].mean()), stopped)

    @torch.inference_mode()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's causal logits `[T, V]` fp32 of a clean sequence at positions 0 ..
        T - 1: row i is the distribution of the token after position i."""
        positions = torch.arange(token_ids.shape[0], device=self.device)  # [T]
        return self.model(token_ids, positions, CausalContext())
