"""What a new user meets on the command line: every error is one line that says what to pass,
decoding settings follow the documented order, and notices fit the device."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from dlmc.cli import main


def _one_line_error(res, *parts):
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for part in parts:
        assert part in lines[0], lines[0]


@pytest.fixture
def no_cuda(monkeypatch):
    """A torch that finds no CUDA device (whatever the machine has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench", "suite", "--problems",
                                                          "gsm8k", "--out", "OUT"]])
def test_a_device_that_cannot_run_is_one_line_naming_the_devices_available(
        tiny_dir, tmp_path, no_cuda, command):
    command = [str(tmp_path / "run") if a == "OUT" else a for a in command]
    runner = CliRunner()
    for device, reason in (("cuda", "'cuda': "), ("cuda:1", "'cuda:1': "),
                           ("tpu", "expected cpu, cuda or cuda:N")):
        res = runner.invoke(main, [*command, "--model", str(tiny_dir), "--device", device])
        _one_line_error(res, f"device '{device}'", reason, "(available here: cpu)")


def test_fp8_kv_cache_picks_bf16_activations_and_errors_say_what_to_pass(tiny_dir):
    runner = CliRunner()
    args = ["generate", "--model", str(tiny_dir), "--device", "cpu", "--kv-cache-dtype", "fp8",
            "--max-new-tokens", "8", "--raw", "--json", "hi"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    settings = json.loads(res.stdout)["settings"]
    assert (settings["dtype"], settings["kv_cache_dtype"]) == ("bfloat16", "fp8")
    res = runner.invoke(main, [*args[:-1], "--mode", "reference", "hi"])
    _one_line_error(res, "kv_cache_dtype 'fp8'", "mode 'reference'", "--mode eager")
    res = runner.invoke(main, [*args[:-1], "--dtype", "fp32", "hi"])
    _one_line_error(res, "kv_cache_dtype 'fp8' needs bf16 activations", "--dtype bf16")
    res = runner.invoke(main, [*args[:-1], "--mode", "graph", "hi"])
    _one_line_error(res, "mode 'graph'", "needs a CUDA device", "--mode eager")


@pytest.fixture(scope="module")
def short_paper_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with a paper_decoding.json that differs from every role default."""
    out = tmp_path_factory.mktemp("paper") / "m"
    shutil.copytree(tiny_dir, out)
    (out / "paper_decoding.json").write_text(json.dumps({"decoding": {
        "threshold": 0.6, "edit_threshold": 0.3, "refine_steps": 2, "max_new_tokens": 12,
        "block_length": 16}}))
    return out


@pytest.mark.parametrize("role", ["orl", "llada2.1", "llada2.0"])
def test_paper_decoding_applies_under_every_role_and_options_beat_it(short_paper_dir, role):
    runner = CliRunner()
    args = ["generate", "--model", str(short_paper_dir), "--role", role, "--raw", "--json",
            "hi"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["settings"]
    joint = role != "llada2.0"
    assert (got["threshold"], got["max_new_tokens"], got["block_length"]) == (0.6, 12, 16)
    assert (got["edit_threshold"], got["max_refine_steps"]) == ((0.3, 2) if joint else (None, 0))
    assert got["temperature"] == 0.0 and got["role"] == role
    res = runner.invoke(main, [*args[:-1], "--threshold", "0.9", "--max-new-tokens", "8",
                               "--block-length", "8", "hi"])
    got = json.loads(res.stdout)["settings"]
    assert (got["threshold"], got["max_new_tokens"], got["block_length"]) == (0.9, 8, 8)


def test_role_defaults_apply_without_paper_decoding(tiny_dir, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(tiny_dir, out)
    (out / "paper_decoding.json").unlink()
    res = CliRunner().invoke(main, ["generate", "--model", str(out), "--role", "llada2.1",
                                    "--raw", "--json", "--max-new-tokens", "8", "hi"])
    got = json.loads(res.stdout)["settings"]
    assert (got["threshold"], got["edit_threshold"], got["max_refine_steps"]) == (0.95, 0.9, 16)


def test_first_rounds_notice_fits_the_mode_and_device(tiny_dir):
    from dlmc.cli.generate import first_rounds_notice

    assert "capture CUDA graphs" in first_rounds_notice("graph", "cuda")
    for device in ("cuda", "cpu"):
        notice = first_rounds_notice("compile", device)
        assert "compile (Inductor" in notice and "no graph capture" in notice
        assert ("CUDA kernels" in notice) == (device == "cuda")
    assert first_rounds_notice("eager", "cpu") is None
    assert first_rounds_notice("reference", "cuda") is None
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_dir), "--device", "cpu",
                                    "--max-new-tokens", "8", "--no-live", "hi"])
    assert res.exit_code == 0, res.output
    assert "compile" not in res.stderr and "CUDA" not in res.stderr  # eager: no notice


def test_a_checkpoint_without_tokenizer_gets_command_line_advice(tmp_path):
    from dlmc.loading.tiny import write_tiny_checkpoint

    directory = write_tiny_checkpoint(tmp_path / "m", seed=2, tokenizer=False)
    for extra in ([], ["--raw"]):
        res = CliRunner().invoke(main, ["generate", "--model", str(directory), *extra, "hi"])
        _one_line_error(res, f"{directory}: no usable tokenizer", "tokenizer.json",
                        "--raw skips only the chat template")
        assert "prompt_token_ids" not in res.output


def test_max_context_bounds_a_request_and_the_model_bounds_it(tiny_dir):
    runner = CliRunner()
    args = ["generate", "--model", str(tiny_dir), "--device", "cpu", "--raw", "hi"]
    res = runner.invoke(main, [*args[:-1], "--max-context", "40", "--max-new-tokens", "64", "hi"])
    _one_line_error(res, "max_new_tokens (64)", "exceeds the model's context of 40")
    res = runner.invoke(main, [*args[:-1], "--max-context", "5000", "hi"])
    _one_line_error(res, "max_context=5000", "max_position_embeddings (4096)")
