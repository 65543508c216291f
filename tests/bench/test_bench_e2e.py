"""End to end: `dlmc bench suite` on the real tiny-llada2 engine, then a resumed rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlmc.cli import main

FILES = ("gsm8k.jsonl", "math500.jsonl", "humaneval.jsonl", "mbpp.jsonl")


@pytest.mark.slow
def test_tiny_llada2_suite_completes_writes_files_and_resumes(
    data_dir: Path, tmp_path: Path
) -> None:
    # Two sets by name (the packaged files), two by path (a user's files).
    out = tmp_path / "run"
    args = ["bench", "suite", "--model", "tiny-llada2", "--role", "orl", "--precision", "auto",
            "--threshold", "0.85", "--edit-threshold", "0.5", "--max-new-tokens", "32",
            "--limit", "2", "--problems", "gsm8k", "math500",
            *(str(data_dir / f) for f in FILES[2:]), "--out", str(out)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "dlmc bench suite" in first.output and "accuracy %" in first.output
    summary = json.loads((out / "summary.json").read_text())
    assert [b["problems"] for b in summary["benchmarks"]] == [2, 2, 2, 2]
    assert summary["engine_settings"]
    for name in ("gsm8k", "math500", "humaneval", "mbpp"):
        records = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(records) == 2
        assert all(r["tokens"] > 0 and r["forwards"] > 0 and r["seconds"] > 0 for r in records)
    before = {f: (out / f"{f}.jsonl").read_text() for f in ("gsm8k", "math500", "mbpp")}

    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0, second.output
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["benchmarks"] == summary["benchmarks"]
    # Finished problems were skipped: the records (outputs, timings) are the first run's.
    assert {f: (out / f"{f}.jsonl").read_text() for f in before} == before


def test_tiny_diffusiongemma_suite_runs_through_llm(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    """The suite drives DiffusionGemma through the same `LLM` (no LLaDA2 option given,
    temperature 0.0 meaning "not given"), passes its sampler's options, and records them."""
    out = tmp_path / "gemma"
    args = ["bench", "suite", "--model", str(tiny_gemma_dir), "--max-new-tokens", "32",
            "--max-denoising-steps", "5", "--t-min", "0.3", "--limit", "1", "--problems",
            "gsm8k", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"][0]["problems"] == 1
    engine = summary["engine_settings"]
    assert engine["model_type"] == "diffusion_gemma" and engine["max_new_tokens"] == 32
    assert engine["seed"] == 0 and engine["sources"]["max_new_tokens"] == "argument"
    assert (engine["max_denoising_steps"], engine["t_min"]) == (5, 0.3)
    assert engine["sources"]["t_min"] == "argument" and engine["t_max"] == 0.8
    assert summary["run"]["max_denoising_steps"] == 5 and summary["run"]["entropy_bound"] is None
    record = json.loads((out / "gsm8k.jsonl").read_text().splitlines()[0])
    # canvases of 32 tokens (tiny-diffusiongemma's), at most 5 decoder steps each
    assert 0 < record["tokens"] <= 32 and 1 <= record["forwards"] <= 5
    # an option of the other model is refused before the first problem, with no record written
    other = tmp_path / "gemma-threshold"
    result = CliRunner().invoke(main, [*args[:-2], "--threshold", "0.9", "--out", str(other)])
    assert result.exit_code == 1 and "decoding option `threshold`: a LLaDA2 setting" in " ".join(
        result.output.split())
    assert "gsm8k" not in result.output and not (other / "gsm8k.jsonl").exists()
