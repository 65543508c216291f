"""`from dlmc import LLM`: load a checkpoint once, then generate from prompts or messages."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dlmc.custom_ops.kernel_config import KernelConfig
from dlmc.engine.block_decoder import BlockDecoder
from dlmc.engine.canvas_config import CANVAS_OPTIONS, CanvasDecodeConfig
from dlmc.engine.canvas_decoder import CanvasDecoder
from dlmc.engine.canvas_runtime import CanvasRuntime
from dlmc.engine.decode_config import DecodeConfig, resolve_decode_config, role_defaults
from dlmc.engine.events import BlockEvent, CanvasRoundEvent, DecodeOutput, RoundEvent
from dlmc.engine.request_checks import checked_max_context, checked_token_ids
from dlmc.engine.stop_sequences import AnswerText, checked_stops
from dlmc.errors import ConfigError, DlmcError, TokenizerError
from dlmc.graphs.canvas_settings import CANVAS_KEYS
from dlmc.kv.attention import MaskedAttention, block_causal_mask
from dlmc.kv.layout import paged_cache_problem
from dlmc.kv.scales import resolve_kv_cache_dtype
from dlmc.loading.hub import resolve_model
from dlmc.loading.loader import load_model, parse_device, parse_dtype
from dlmc.loading.special_ids import resolve_special_ids
from dlmc.models.layers import fuse_gate_up_projections
from dlmc.models.moe import fuse_shared_experts
from dlmc.results import BlockChunk, Done, GenerateResult

log = logging.getLogger(__name__)
_UNSET: Any = object()
StreamEvent = RoundEvent | CanvasRoundEvent | BlockChunk | Done


class LLM:
    """A loaded diffusion LM and its decoder.

    `model`: local checkpoint directory, Hugging Face repo id, or a built-in tiny random-weight
    model (`tiny-llada2`, `tiny-diffusiongemma`). The decoder follows config.json's
    `model_type`: LLaDA2's block decoder for `llada2_moe`, the entropy-bound canvas decoder for
    `diffusion_gemma` (`dlmc.engine.canvas_runtime`; role "orl" only, settings from
    generation_config.json then paper_decoding.json; every mode below).
    `role`: the decoder and its default settings, "orl" (threshold 0.85, edit 0.5, 16 refine
    steps), "llada2.1" or "llada2.0"; under every role the checkpoint's paper_decoding.json
    overrides them, and `generate`'s arguments override both (docs/llada2.md §6).
    `precision`: "auto", "bf16" or "nvfp4". `device`: "cpu", "cuda" or "cuda:N" (default: CUDA
    if available). `dtype`: default bf16 on CUDA or with `kv_cache_dtype="fp8"`, else fp32.
    `mode`: how rounds run: "graph" (compiled + CUDA graphs, the default on CUDA), "compile",
    "eager" (the default on CPU) or "reference" (plain PyTorch, exact-length attention).
    `kv_cache_dtype`: "auto" (FP8 when the checkpoint declares an FP8 KV cache and activations
    are bf16), "bf16" or "fp8" (paged cache, K/V quantized with the checkpoint's scales;
    DiffusionGemma: its static cache in FP8 with the per-layer scales, "bf16" its activation
    dtype).
    `refresh`: how a finished block whose last round changed it gets its final K/V cached:
    "fused" (default: inside the next block's first round, one 2-block forward) or "separate"
    (a forward of its own; the reference mode always does this).
    `lookahead`: rounds under the LLaDA2.1 rule are queued one ahead of the host's read
    of the last round's flags while the block still has masks (a round that may end the block
    is read first), so the GPU does not idle between rounds; the same rounds and tokens as
    without (default True).
    `max_context`: positions a request's prompt and answer may take in all (default and at
    most: the config's max_position_embeddings).
    `kernels`: the kernel choices (`KernelConfig`: attention backend, programmatic dependent
    launch, deterministic compilation); the defaults are the fastest measured.
    `revision`: a branch, tag or commit of a Hub repo `model` (default: its main branch).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        role: str = "orl",
        precision: str = "auto",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_context: int | None = None,
        show_progress: bool = False,
        mode: str | None = None,
        kv_cache_dtype: str = "auto",
        refresh: str = "fused",
        lookahead: bool = True,
        kernels: KernelConfig | None = None,
        revision: str | None = None,
    ) -> None:
        role_defaults(role)  # validates the role
        self.device = parse_device(device)  # before any download
        self.dtype = parse_dtype(dtype, self.device, kv_cache_dtype)
        self.mode = mode or ("graph" if self.device.type == "cuda" else "eager")
        if self.mode not in ("graph", "compile", "eager", "reference"):
            raise ConfigError(
                f"mode {self.mode!r}: expected one of graph, compile, eager, reference"
            )
        if self.mode == "graph" and self.device.type != "cuda":
            raise ConfigError(f"mode 'graph' (CUDA graphs) needs a CUDA device, got device "
                              f"{str(self.device)!r}; use mode 'eager' (--mode eager) or 'compile'")
        self.model_id = os.fspath(model)
        self.model_dir: Path = resolve_model(model, revision)
        self.role = role
        if kernels is not None and not isinstance(kernels, KernelConfig):
            raise ConfigError(f"kernels={kernels!r}: expected a dlmc.KernelConfig")
        self.kernels = kernels or KernelConfig()
        loaded = load_model(self.model_dir, self.device, self.dtype, precision, show_progress,
                            self.kernels)
        self.config, self.model, self.precision = loaded.config, loaded.model, loaded.precision
        self.kv_scales = loaded.kv_scales
        max_context = checked_max_context(max_context, self.config.max_position_embeddings)
        self._tokenizer: Any = None
        self._canvas: CanvasRuntime | None = None
        self._decoder: BlockDecoder | CanvasDecoder
        if loaded.model_type == "diffusion_gemma":
            self._canvas = CanvasRuntime(self.model, self.model_dir, role, self.device,
                                         self.dtype, mode, kv_cache_dtype, max_context,
                                         self.kernels, loaded.kv_scales,
                                         loaded.declares_fp8_kv)
            self.mode, self.kv_cache_dtype = self._canvas.mode, self._canvas.kv_cache_dtype
            self.special_ids, self.max_context = self._canvas.special_ids, self._canvas.max_context
            self._decoder = self._canvas.decoder
            return
        if self.device.type == "cuda":  # one grouped kernel pair for routed + shared experts
            fuse_shared_experts(self.model)
            fuse_gate_up_projections(self.model)  # one GEMM for gate + up of dense MLPs
        declares_fp8 = loaded.declares_fp8_kv and not paged_cache_problem(
            self.device, self.dtype, self.mode)  # "auto" picks FP8 only where it runs
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, declares_fp8)
        if any("self_conditioning" in n for n in loaded.index.tensors):
            log.warning("%s carries self-conditioning weights, which dlmc does not apply yet",
                        self.model_dir)
        elif role_defaults(role).self_conditioning:
            log.info("%s has no self-conditioning weights: decoding without self-conditioning",
                     self.model_dir)
        self.special_ids = resolve_special_ids(self.model_dir, self._tokenizer_special_ids)
        self.max_context = max_context
        self._decoder = BlockDecoder(
            self.model, self.special_ids.mask_token_id, self.special_ids.eos_token_id,
            self.max_context, self.device, self.dtype, mode=self.mode,
            kv_cache_dtype=self.kv_cache_dtype, kv_scales=self.kv_scales, refresh=refresh,
            lookahead=lookahead, kernels=self.kernels,
        )

    # -- tokenizer -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The checkpoint's transformers tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
            if not any((self.model_dir / f).is_file() for f in files):
                raise TokenizerError(self.model_dir, f"none of {', '.join(files)}")
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # it warns that it does not know llada2_moe
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            except Exception as exc:
                reason = " ".join(str(exc).split())
                raise TokenizerError(self.model_dir, f"{type(exc).__name__}: {reason}") from None
            finally:
                hf_logging.set_verbosity(verbosity)
        return self._tokenizer

    def _tokenizer_special_ids(self) -> dict[str, int | None]:
        tok = self.tokenizer
        return {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id}

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> list[int]:
        """Exactly one of: raw text, chat messages (rendered with the checkpoint's template),
        or token ids."""
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise ConfigError("give exactly one of prompt, messages or prompt_token_ids")
        if prompt_token_ids is not None:
            return checked_token_ids(prompt_token_ids, "prompt_token_ids",
                                     self.config.vocab_size, allow_empty=True)
        if prompt is not None and not isinstance(prompt, str):
            raise ConfigError(f"prompt: expected a string, got {type(prompt).__name__} (a list "
                              "of prompts goes to generate, which returns a list)")
        if messages is not None:
            if not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise ConfigError("messages: expected a non-empty list of {role, content} dicts")
            if self._canvas is not None:
                messages = self._canvas.text_messages(messages)
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return self._canvas.with_bos(ids) if self._canvas is not None and ids else ids

    def decode_text(self, token_ids: list[int] | tuple[int, ...]) -> str:
        try:
            tok = self.tokenizer
        except DlmcError:
            return ""
        return tok.decode(list(token_ids), skip_special_tokens=True)

    # -- decoding --------------------------------------------------------------------------
    def decode_settings(self, **overrides: Any) -> DecodeConfig | CanvasDecodeConfig:
        """Effective settings: role defaults < the checkpoint's paper_decoding.json (every
        role) < explicit overrides (DiffusionGemma: generation_config.json <
        paper_decoding.json < explicit overrides)."""
        given = {k: v for k, v in overrides.items() if v is not _UNSET}
        if self._canvas is not None:
            return self._canvas.decode_settings(given)
        canvas = [key for key in given if key in CANVAS_KEYS]
        if canvas:
            raise ConfigError(f"decoding option `{canvas[0]}`: a DiffusionGemma setting; "
                              "LLaDA2's decoder takes max_new_tokens, threshold, edit_threshold, "
                              "max_refine_steps, block_length, temperature, top_k, top_p and seed")
        return resolve_decode_config(self.role, self.model_dir, given)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        max_new_tokens: int | None = None,
        threshold: float | None = None,
        edit_threshold: Any = _UNSET,
        max_refine_steps: int | None = None,
        block_length: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        rounds: bool = False,
        use_cache: bool = True,
        cancel: Callable[[], bool] | None = None,
        **sampler: Any,
    ) -> Iterator[StreamEvent]:
        """Yield a BlockChunk per finished block (and a RoundEvent per round if `rounds`),
        then Done(result). `cancel()` is polled every round. A decoding setting left None
        (`edit_threshold`: left out) takes the checkpoint's paper_decoding.json, else the
        role's default (`decode_settings`). `stop`: stop sequences; the answer ends before
        the first one that appears (finish_reason "stop", `stop_reason` names it; text that
        may begin one is held back, and a last BlockChunk without ids sends what was held if
        none appears).

        DiffusionGemma: a BlockChunk per appended canvas and, with `rounds`, a
        CanvasRoundEvent per denoising step; `sampler` takes its settings (max_denoising_steps,
        t_min, t_max, entropy_bound, stability_threshold, confidence_threshold); LLaDA2's
        options are refused by name."""
        unknown = [key for key in sampler if key not in CANVAS_OPTIONS]
        if unknown:
            raise TypeError(f"LLM.stream() got an unexpected keyword argument {unknown[0]!r}")
        ids = self.encode_prompt(prompt, messages, prompt_token_ids)
        named = dict(
            max_new_tokens=max_new_tokens,
            threshold=threshold,
            max_refine_steps=max_refine_steps,
            block_length=block_length,
            temperature=float(temperature) if type(temperature) is int else temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        overrides = {k: v for k, v in named.items() if v is not None}
        if edit_threshold is not _UNSET:
            overrides["edit_threshold"] = edit_threshold
        cfg = self.decode_settings(**overrides, **sampler)
        stops = checked_stops(stop)
        settings = self._record(cfg) | ({"stop": list(stops)} if stops else {})
        text = AnswerText(self.decode_text, stops)

        def halt() -> bool:  # a stop sequence ends the decode as a cancel does
            return text.stop is not None or (cancel is not None and cancel())

        started = time.perf_counter()
        steps = self._decoder.decode(ids, cfg, use_cache=use_cache, rounds=rounds,
                                     cancel=halt if stops or cancel is not None else None)
        index, blocks = -1, 0
        while True:
            try:
                event = next(steps)
            except StopIteration as end:
                out: DecodeOutput = end.value
                break
            if isinstance(event, BlockEvent):
                kept, sent = text.add(event.answer_ids)
                index, blocks = event.block_index, blocks + 1
                yield BlockChunk(index, kept, sent)
            else:
                yield event
        held = text.flush()
        if held:
            yield BlockChunk(index, (), held)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        answer, finish, tpf = list(out.answer_ids), out.finish_reason, out.tokens_per_forward
        if text.stop is not None:  # the decoder saw a cancel: the stop's counts are ours
            answer, finish, tpf = text.ids, "stop", None
        else:
            blocks = out.blocks
        n = len(answer)
        if tpf is None:
            tpf = n / out.num_forwards if out.num_forwards else 0.0
        yield Done(
            GenerateResult(
                text=text.text if text.stop is not None else self.decode_text(answer),
                token_ids=answer,
                prompt_token_ids=ids,
                num_forwards=out.num_forwards,
                total_forwards=out.total_forwards,
                tokens_per_forward=tpf,
                request_tps=n / elapsed if elapsed > 0 else 0.0,
                elapsed_s=elapsed,
                finish_reason=finish,
                blocks=blocks,
                settings=settings,
                stop_reason=text.stop,
            )
        )

    def generate(self, prompt: str | list[str] | None = None,
                 **kwargs: Any) -> GenerateResult | list[GenerateResult]:
        """Decode one request to the end; same arguments as `stream` (without `rounds`). A
        list of prompts gives a list of results, decoded one after another with the same
        arguments."""
        if isinstance(prompt, list | tuple):
            if not prompt or not all(isinstance(p, str) for p in prompt):
                raise ConfigError("prompt: expected a string or a non-empty list of strings")
            return [self.generate(p, **kwargs) for p in prompt]
        known = [name for name, param in inspect.signature(LLM.stream).parameters.items()
                 if param.kind is not inspect.Parameter.VAR_KEYWORD] + list(CANVAS_OPTIONS)
        unknown = [key for key in kwargs if key not in known]
        if unknown:
            raise TypeError(
                f"LLM.generate() got an unexpected keyword argument {unknown[0]!r}; expected "
                f"some of {', '.join(k for k in known if k not in ('self', 'prompt', 'rounds'))}")
        for event in self.stream(prompt, **kwargs):
            if isinstance(event, Done):
                return event.result
        raise AssertionError("stream ended without a result")  # pragma: no cover

    def _record(self, cfg: DecodeConfig | CanvasDecodeConfig) -> dict[str, Any]:
        common = {"role": self.role, "precision": self.precision,
                  "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                  "kernels": self.kernels.to_dict()}
        if self._canvas is not None:
            assert isinstance(cfg, CanvasDecodeConfig)
            return self._canvas.record(cfg, common)
        assert isinstance(cfg, DecodeConfig) and isinstance(self._decoder, BlockDecoder)
        return {
            **cfg.to_dict(),
            **common,
            "mode": self.mode if cfg.greedy or self._decoder.paged else "reference",
            "kv_cache_dtype": self.kv_cache_dtype,
            "refresh": self._decoder.refresh,
            "lookahead": self._decoder.lookahead,
            "self_conditioning_active": False,
            "mask_token_id": self.special_ids.mask_token_id,
            "eos_token_id": self.special_ids.eos_token_id,
        }

    @torch.inference_mode()
    def logits(
        self, token_ids: list[int] | torch.Tensor, block_length: int | None = None
    ) -> torch.Tensor:
        """fp32 logits `[len, vocab]` of a whole sequence at positions 0 .. len - 1.

        LLaDA2: one forward under the block-causal mask (`block_length`: default the
        decoding setting's); row i scores the token at position i. DiffusionGemma: the
        encoder's causal pass (no canvas, no self-conditioning; sliding windows applied), the
        soft-capped logits; row i scores the token after position i, as a causal LM's do.
        """
        ids = torch.tensor(checked_token_ids(token_ids, "token_ids", self.config.vocab_size),
                           dtype=torch.long, device=self.device)
        if ids.shape[0] > self.max_context:
            raise ConfigError(f"token_ids: {ids.shape[0]} tokens exceed the model's context of "
                              f"{self.max_context}")
        if self._canvas is not None:
            if block_length is not None:
                raise ConfigError("block_length: a LLaDA2 option; DiffusionGemma's logits "
                                  "are the encoder's causal logits")
            return self._canvas.logits(ids)
        bl = block_length or self.decode_settings().block_length
        pos = torch.arange(ids.shape[0], device=self.device)
        mask = block_causal_mask(pos, pos, bl, self.dtype)
        return self.model(ids, pos, MaskedAttention(mask))
