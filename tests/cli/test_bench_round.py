"""`dlmc bench round`'s option checks (the timing itself needs a GPU: perf/)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dlmc.cli.bench import bench


def test_a_negative_temperature_is_refused_by_name():
    result = CliRunner().invoke(bench, ["round", "--temperature", "-0.5"])
    assert result.exit_code == 2
    assert "--temperature" in result.output and "-0.5" in result.output


def test_without_a_gpu_the_command_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(bench, ["round", "--temperature", "0.7"])
    assert result.exit_code != 0
    assert "needs a CUDA GPU" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "llada3"], "--shape 'llada3': expected one of llada2.1-mini, diffusiongemma"),
    (["--modes", "eager,fast"], "--modes 'eager,fast': expected a comma-separated list"),
    (["--rounds", "0"], "--rounds 0: expected an integer >= 1"),
    (["--prefix", "-1"], "--prefix -1: expected an integer >= 0"),
    (["--canvas", "128"], "--canvas: not an option of LLaDA2's round"),
    (["--shape", "diffusiongemma-26b-a4b", "--block-length", "32"],
     "--block-length: not an option of diffusiongemma-26b-a4b's round (its canvas is --canvas)"),
    (["--shape", "diffusiongemma-26b-a4b", "--no-fuse-shared-expert"],
     "--fuse-shared-expert: not an option of diffusiongemma-26b-a4b's round"),
])
def test_bad_options_are_refused_before_the_gpu_check(monkeypatch, args, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(bench, ["round", *args])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split()) and "CUDA" not in result.output


def test_diffusiongemma_options_the_canvas_step_does_not_take_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = CliRunner().invoke(bench, ["round", "--shape", "diffusiongemma-26b-a4b",
                                        "--precision", "nvfp4", "--kv-cache-dtype", "fp8",
                                        "--kv-layout", "paged"])
    assert result.exit_code != 0
    assert "--shape diffusiongemma-26b-a4b: --kv-layout paged: DiffusionGemma's cache is the " \
        "dense static cache" in " ".join(result.output.split())


def test_diffusiongemma_takes_the_loop_option(monkeypatch):
    """--loop (the default) and --no-loop reach DiffusionGemma's bench."""
    import dlmc.cli.bench_canvas

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dlmc.cli.bench_canvas, "canvas_round",
                        lambda *args, **kwargs: calls.append(kwargs["loop"]))
    for flag in ([], ["--no-loop"], ["--loop"]):
        result = CliRunner().invoke(bench, ["round", "--shape", "diffusiongemma-26b-a4b",
                                            *flag])
        assert result.exit_code == 0, result.output
    assert calls == [True, False, True]


def test_diffusiongemma_takes_the_bf16_experts_and_attention_choices(monkeypatch):
    """--gemma-bf16-experts, --gemma-attention, --no-nvfp4-pad-experts, --split-reductions,
    --gemma-fused-projections and --nvfp4-tiles reach the canvas bench's `KernelConfig`
    (defaults auto, auto, on, auto, on, the op's tiles); another value is refused by name."""
    import dlmc.cli.bench_canvas

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dlmc.cli.bench_canvas, "canvas_round",
                        lambda *args, **kwargs: chosen.append(
                            (args[6].gemma_bf16_experts, args[6].gemma_attention,
                             args[6].nvfp4_pad_experts, args[6].split_reductions,
                             args[6].gemma_fused_projections, args[6].nvfp4_tiles)))
    for flag in ([], ["--gemma-bf16-experts", "grouped_mm", "--gemma-attention", "torch",
                      "--no-nvfp4-pad-experts", "--split-reductions", "off",
                      "--no-gemma-fused-projections", "--nvfp4-tiles", "block_m=32"]):
        result = CliRunner().invoke(bench, ["round", "--shape", "diffusiongemma-26b-a4b",
                                            *flag])
        assert result.exit_code == 0, result.output
    assert chosen == [("auto", "auto", True, "auto", True, ""),
                      ("grouped_mm", "torch", False, "off", False, "block_m=32")]
    result = CliRunner().invoke(bench, ["round", "--gemma-bf16-experts", "cutlass"])
    assert result.exit_code == 2
    assert "--gemma-bf16-experts" in result.output and "cutlass" in result.output
    result = CliRunner().invoke(bench, ["round", "--nvfp4-tiles", "block_m=48"])
    assert result.exit_code == 2
    assert "'--nvfp4-tiles'" in result.output and "block_m=48" in result.output


def test_llada2_takes_the_post_attention_fusion_choice(monkeypatch):
    """--fused-post-attention-norm (the default) and --no-fused-post-attention-norm reach the
    LLaDA2 round's `KernelConfig`, which the bench's model is built with."""
    import dlmc.cli.bench_round

    class Built(Exception):
        pass

    chosen = []

    def build(model, shape, device, precision, kernels):
        chosen.append(kernels.fused_post_attention_norm)
        raise Built

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dlmc.cli.bench_round, "_build", build)
    for flag in ([], ["--no-fused-post-attention-norm"], ["--fused-post-attention-norm"]):
        result = CliRunner().invoke(bench, ["round", *flag])
        assert isinstance(result.exception, Built), result.output
    assert chosen == [True, False, True]


def test_a_diffusiongemma_checkpoint_is_sent_to_its_shape(tiny_gemma_dir):
    """--model takes a LLaDA2 checkpoint; DiffusionGemma's step is timed with its --shape."""
    from dlmc.cli.bench_round import _build
    from dlmc.custom_ops.kernel_config import KernelConfig
    from dlmc.errors import ConfigError

    with pytest.raises(ConfigError, match=r"a DiffusionGemma checkpoint; .* --shape diffusion"):
        _build(str(tiny_gemma_dir), "llada2.1-mini", torch.device("cpu"), "bf16", KernelConfig())
