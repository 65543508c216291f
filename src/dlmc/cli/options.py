"""Options shared by `generate`, `bench` and `serve`, and error handling for commands."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from dlmc.errors import DlmcError, TokenizerError
from dlmc.graphs.canvas_settings import CANVAS_KEYS


class EditThreshold(click.ParamType):
    """A number in [0, 1], or `none` to disable token-to-token edits."""

    name = "FLOAT|none"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None or isinstance(value, float) or value == "default":
            return value
        if str(value).strip().lower() in ("none", "off", "null", "false"):
            return None
        try:
            return float(value)
        except ValueError:
            self.fail(f"expected a number or 'none', got {value!r}", param, ctx)


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--model --revision --role --precision --device --dtype --max-context --mode
    --kv-cache-dtype (--revision and the last three reach the command in **kwargs; pass them
    on with `engine_kwargs`)."""
    decorators = [
        click.option(
            "--model",
            "-m",
            required=True,
            metavar="DIR|REPO|tiny-llada2",
            help="Checkpoint directory, Hugging Face repo id, or a built-in "
            "`tiny-llada2` / `tiny-diffusiongemma` (random weights: gibberish output).",
        ),
        click.option(
            "--revision",
            default=None,
            metavar="REF",
            help="Branch, tag or commit of a Hub repo --model (default: its main branch).",
        ),
        click.option(
            "--role",
            type=click.Choice(["orl", "llada2.1", "llada2.0"]),
            default="orl",
            show_default=True,
            help="Decoder and its default settings: ORL paper, LLaDA2.1 joint threshold, or "
            "LLaDA2.0 threshold. Under every role the checkpoint's paper_decoding.json "
            "overrides the defaults, and the decoding options override both.",
        ),
        click.option(
            "--precision",
            type=click.Choice(["auto", "bf16", "nvfp4"]),
            default="auto",
            show_default=True,
            help="Routed-expert precision (auto: nvfp4 for NVFP4 checkpoints on GPU).",
        ),
        click.option("--device", default=None,
                     help="cpu, cuda or cuda:N (default: cuda if there is one)."),
        click.option(
            "--dtype",
            type=click.Choice(["bf16", "fp16", "fp32"]),
            default=None,
            help="Activation dtype (default: bf16 on CUDA or with --kv-cache-dtype fp8, else "
            "fp32).",
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=1),
            default=None,
            help="Positions a request's prompt and answer may take in all (default and at "
            "most: the model's max_position_embeddings).",
        ),
        click.option(
            "--mode",
            type=click.Choice(["graph", "compile", "eager", "reference"]),
            default=None,
            help="How rounds run (default: graph = compiled + CUDA graphs on CUDA, eager on CPU).",
        ),
        click.option(
            "--kv-cache-dtype",
            type=click.Choice(["auto", "bf16", "fp8"]),
            default="auto",
            show_default=True,
            help="KV cache storage (auto: FP8 when the checkpoint declares an FP8 KV cache and "
            "activations are bf16; LLaDA2's fp8 needs bf16 activations, the default with it; "
            "DiffusionGemma's FP8 cache reads back in the activation dtype).",
        ),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def decode_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--threshold --edit-threshold --max-refine-steps --max-new-tokens --block-length ... and
    DiffusionGemma's options (`canvas_options`)."""
    decorators = [
        click.option(
            "--threshold",
            type=float,
            default=None,
            help="Mask-to-token commit threshold (default: the checkpoint's "
            "paper_decoding.json, else the role's: orl 0.85, llada2.1 and llada2.0 0.95).",
        ),
        click.option(
            "--edit-threshold",
            type=EditThreshold(),
            default="default",
            help="Token-to-token edit threshold, or `none` (default: the checkpoint's "
            "paper_decoding.json, else the role's: orl 0.5, llada2.1 0.9; llada2.0 has no "
            "edits).",
        ),
        click.option(
            "--max-refine-steps",
            type=int,
            default=None,
            help="Post-fill edit rounds per block (default: the checkpoint's "
            "paper_decoding.json, else 16; llada2.0: 0).",
        ),
        click.option(
            "--max-new-tokens",
            type=int,
            default=None,
            help="Answer length limit (default: the checkpoint's paper_decoding.json, else "
            "the role's: orl 4096, llada2.1 and llada2.0 2048; DiffusionGemma: its "
            "generation_config.json, else 256, and its answers grow by whole canvases, so "
            "they may pass the limit by up to a canvas less one token, as in transformers).",
        ),
        click.option("--block-length", type=int, default=None,
                     help="Block size (default: the checkpoint's paper_decoding.json, else 32)."),
        click.option("--temperature", type=float, default=None,
                     help="Sampling temperature in [0, 100]; below 1e-5 greedy (default: the "
                     "checkpoint's paper_decoding.json, else 0: greedy)."),
        click.option("--top-k", type=int, default=None),
        click.option("--top-p", type=float, default=None),
        click.option("--seed", type=int, default=None,
                     help="Seed for sampling, in [0, 2**63 - 1]."),
    ]
    fn = canvas_options(fn)  # listed after the options above
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def canvas_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """DiffusionGemma's --max-denoising-steps --t-min --t-max --entropy-bound
    --stability-threshold --confidence-threshold (CANVAS_KEYS; None when not given, and passed
    on only when given)."""
    decorators = [
        click.option("--max-denoising-steps", type=int, default=None,
                     help="DiffusionGemma: steps per canvas at most (default: the checkpoint's "
                     "generation_config.json, 48)."),
        click.option("--t-min", type=float, default=None,
                     help="DiffusionGemma: temperature at the last step (default 0.4)."),
        click.option("--t-max", type=float, default=None,
                     help="DiffusionGemma: temperature at the first step (default 0.8)."),
        click.option("--entropy-bound", type=float, default=None,
                     help="DiffusionGemma: acceptance budget in nats per step (default 0.1)."),
        click.option("--stability-threshold", type=int, default=None,
                     help="DiffusionGemma: steps the argmax canvas must stay unchanged before "
                     "a canvas may stop (default 1)."),
        click.option("--confidence-threshold", type=float, default=None,
                     help="DiffusionGemma: a canvas stops once stable with a mean entropy "
                     "below this (default 0.005)."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _checked_tiles(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--nvfp4-tiles as `KernelConfig` checks it, refused as a bad value of the option."""
    from dlmc.custom_ops.kernel_config import KernelConfig

    try:
        KernelConfig(nvfp4_tiles=value)
    except DlmcError as exc:
        raise click.BadParameter(error_line(exc).split(": ", 1)[-1]) from None
    return value


def kernel_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--attention-backend --pdl/--no-pdl --deterministic-compile --gemma-bf16-experts
    --gemma-attention --gemma-sampler --gemma-fused-projections/--no-...
    --fused-post-attention-norm/--no-... --nvfp4-pad-experts/--no-... --nvfp4-tiles
    --split-reductions,
    handed to the command as one `kernels` argument (a `KernelConfig`)."""
    from dlmc.custom_ops.kernel_config import (
        ATTENTION_BACKENDS,
        GEMMA_ATTENTION,
        GEMMA_BF16_EXPERTS,
        GEMMA_SAMPLER,
        SPLIT_REDUCTIONS,
        KernelConfig,
    )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["kernels"] = KernelConfig(
            attention_backend=kwargs.pop("attention_backend"), pdl=kwargs.pop("pdl"),
            deterministic_compile=kwargs.pop("deterministic_compile"),
            gemma_bf16_experts=kwargs.pop("gemma_bf16_experts"),
            gemma_attention=kwargs.pop("gemma_attention"),
            gemma_sampler=kwargs.pop("gemma_sampler"),
            gemma_fused_projections=kwargs.pop("gemma_fused_projections"),
            fused_post_attention_norm=kwargs.pop("fused_post_attention_norm"),
            nvfp4_pad_experts=kwargs.pop("nvfp4_pad_experts"),
            nvfp4_tiles=kwargs.pop("nvfp4_tiles"),
            split_reductions=kwargs.pop("split_reductions"))
        return fn(*args, **kwargs)

    def auto_choice(flag: str, choices: tuple[str, ...], help: str) -> Callable[..., Any]:
        return click.option(flag, type=click.Choice(choices), default="auto", show_default=True,
                            help=help)

    decorators = [
        auto_choice("--attention-backend", ATTENTION_BACKENDS,
                    help="Paged-cache attention: auto (Triton on CUDA), triton, or reference "
                    "(plain PyTorch, for debugging)."),
        click.option("--pdl/--no-pdl", default=True, show_default=True,
                     help="Programmatic dependent launch of the round's kernels (sm_90+)."),
        click.option("--deterministic-compile", is_flag=True,
                     help="Inductor's deterministic mode (no timing-based kernel choices)."),
        auto_choice("--gemma-bf16-experts", GEMMA_BF16_EXPERTS,
                    help="DiffusionGemma's BF16 routed experts: torch._grouped_mm, or triton "
                    "(dlmc::bf16_moe, gelu-tanh); auto: triton on CUDA."),
        auto_choice("--gemma-attention", GEMMA_ATTENTION,
                    help="DiffusionGemma's compiled steps: attention in plain PyTorch "
                    "(Inductor) or triton (dlmc::paged_attention over the cache); auto: triton "
                    "for a bf16 cache on CUDA."),
        auto_choice("--gemma-sampler", GEMMA_SAMPLER,
                    help="DiffusionGemma's steps: the proposal over the vocabulary in torch "
                    "ops (Inductor) or triton (dlmc::canvas_propose, chunked rows); auto: "
                    "triton on CUDA."),
        click.option("--gemma-fused-projections/--no-gemma-fused-projections", default=True,
                     show_default=True,
                     help="DiffusionGemma's q/k/v projections and dense gate/up as one matrix "
                     "product each (weights concatenated at load)."),
        click.option("--fused-post-attention-norm/--no-fused-post-attention-norm",
                     default=True, show_default=True,
                     help="LLaDA2's o_proj, residual, post-attention norm and router GEMM in "
                     "two launches (dlmc::linear_residual, dlmc::norm_router_gemm)."),
        click.option("--nvfp4-pad-experts/--no-nvfp4-pad-experts", default=True,
                     show_default=True,
                     help="NVFP4 experts of a width that is not a multiple of 128 "
                     "(DiffusionGemma's 704) widened with zeros at load, so that they take "
                     "kernel v7's layout instead of v3 (9 % more expert bytes at 704)."),
        click.option("--nvfp4-tiles", default="", metavar="NAME=VALUE,...",
                     callback=_checked_tiles,
                     help="NVFP4 experts: changes to the op's tiles for each shape, e.g. "
                     "block_m=32,down_warps=8 (both projections in the Triton kernels); "
                     "empty: the op's choice."),
        auto_choice("--split-reductions", SPLIT_REDUCTIONS,
                    help="Inductor's split reductions over few long rows; off: one program "
                    "per row and its online softmax (DiffusionGemma's vocabulary-wide "
                    "sampler); auto: off for DiffusionGemma, on for LLaDA2."),
    ]
    for decorator in reversed(decorators):
        wrapper = decorator(wrapper)
    return wrapper


def engine_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """The LLM constructor's --max-context / --mode / --kv-cache-dtype / --revision (and
    `kernels`, from `kernel_options`) among a command's parameters."""
    kwargs = {"max_context": params.get("max_context"), "mode": params.get("mode"),
              "kv_cache_dtype": params.get("kv_cache_dtype") or "auto",
              "revision": params.get("revision")}
    if params.get("kernels") is not None:
        kwargs["kernels"] = params["kernels"]
    return kwargs


def decode_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """The LLM.generate keyword arguments among a command's parameters."""
    keys = (
        "threshold",
        "max_refine_steps",
        "max_new_tokens",
        "block_length",
        "temperature",
        "top_k",
        "top_p",
        "seed",
    )
    kwargs = {k: params[k] for k in keys if k in params}
    kwargs.update({k: params[k] for k in CANVAS_KEYS if params.get(k) is not None})
    if params.get("edit_threshold") != "default":
        kwargs["edit_threshold"] = params.get("edit_threshold")
    return kwargs


def error_line(exc: DlmcError) -> str:
    """The one line the command line shows for `exc`: its message, with advice that the command
    line can follow where the message's is the Python API's (a missing tokenizer)."""
    if isinstance(exc, TokenizerError):
        return (f"{exc.directory}: no usable tokenizer ({exc.reason}); the command line encodes "
                "text with the checkpoint's tokenizer (--raw skips only the chat template): add "
                "the tokenizer files of the model it was made from (tokenizer.json, "
                "tokenizer_config.json) to that directory")
    return " ".join(str(exc).split())


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Show dlmc's input errors as one clean line instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DlmcError as exc:
            raise click.ClickException(error_line(exc)) from None

    return wrapper
