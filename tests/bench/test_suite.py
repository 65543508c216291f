"""The suite runner with a fake engine: records, summaries, resume, run-file checks, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_fake_llm import FakeLLM, key_of
from click.testing import CliRunner

from dlmc.bench.problems import load_problem_set
from dlmc.bench.prompts import plan_prompts
from dlmc.bench.suite import SuiteSettings, check_run_file, run_benchmark, run_info
from dlmc.cli import main
from dlmc.errors import ConfigError


def _run(llm: FakeLLM, data_dir: Path, out: Path, limit: int, file: str = "gsm8k.jsonl"):
    problems = load_problem_set(str(data_dir / file), limit=limit)
    plan, shots = plan_prompts(problems, "chat", False)
    settings = SuiteSettings(max_new_tokens=64, threshold=0.85)
    return run_benchmark(llm, problems, plan, shots, settings, out)


def test_records_summary_and_resume(data_dir: Path, tmp_path: Path,
                                    gsm8k_rows: list[dict[str, Any]]) -> None:
    llm = FakeLLM(gsm8k_rows[:6], wrong_keys={key_of(gsm8k_rows[1]), key_of(gsm8k_rows[3])})
    summary = _run(llm, data_dir, tmp_path, limit=4)
    assert (summary.problems, summary.correct, summary.accuracy) == (4, 2, 50.0)
    assert summary.forwards == 8 and summary.seconds == pytest.approx(2.0)
    assert summary.tokens_per_forward == pytest.approx(summary.tokens / 8)
    assert llm.calls[0]["max_new_tokens"] == 64 and llm.calls[0]["threshold"] == 0.85
    assert llm.calls[0]["edit_threshold"] is Ellipsis  # unset: the engine's default
    lines = (tmp_path / "gsm8k.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert set(record) >= {"id", "prompt", "output", "extracted", "correct", "forwards", "tokens",
                           "seconds"}
    assert record["correct"] and record["extracted"] == "18"
    assert [json.loads(line)["correct"] for line in lines] == [True, False, True, False]

    # Resume: a torn last line is dropped, finished problems are skipped.
    with open(tmp_path / "gsm8k.jsonl", "a") as f:
        f.write('{"id": "row-4", "prompt"')
    llm.calls.clear()
    summary = _run(llm, data_dir, tmp_path, limit=6)
    assert len(llm.calls) == 2 and (summary.problems, summary.correct) == (6, 4)
    assert len((tmp_path / "gsm8k.jsonl").read_text().splitlines()) == 6


def test_run_file_refuses_to_resume_with_other_settings(tmp_path: Path) -> None:
    first = run_info("m", "orl", "auto", SuiteSettings(threshold=0.85))
    check_run_file(tmp_path, first)
    check_run_file(tmp_path, first)
    with pytest.raises(ConfigError, match=r"run\.json.*threshold=0\.85"):
        check_run_file(tmp_path, run_info("m", "orl", "auto", SuiteSettings(threshold=0.9)))


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        SuiteSettings(threshold=1.5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SuiteSettings(max_new_tokens=0)


def test_cli_runs_the_four_packaged_sets_by_name_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    gsm8k_rows: list[dict[str, Any]], math_rows: list[dict[str, Any]],
    humaneval_rows: list[dict[str, Any]], mbpp_rows: list[dict[str, Any]],
) -> None:
    rows = gsm8k_rows[:3] + math_rows[:3] + humaneval_rows[:3] + mbpp_rows[10:13]
    llm = FakeLLM(rows, wrong_keys={key_of(math_rows[2]), key_of(mbpp_rows[12])})
    monkeypatch.setattr("dlmc.cli.bench._load_llm", lambda *args: llm)
    out = tmp_path / "run"
    args = ["bench", "suite", "--model", "fake", "--threshold", "0.85", "--edit-threshold", "0.5",
            "--max-new-tokens", "32", "--limit", "3", "--problems", "gsm8k", "math500",
            "humaneval", "mbpp", "--out", str(out)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert len(llm.calls) == 12 and "dlmc bench suite" in first.output
    assert llm.checked[0] == {k: llm.calls[0][k] for k in ("max_new_tokens", "threshold",
                                                              "edit_threshold", "seed")} | {
        "temperature": 0.0}  # the settings are checked once, before the first problem
    summary = json.loads((out / "summary.json").read_text())
    scores = {b["name"]: (b["problems"], b["correct"]) for b in summary["benchmarks"]}
    assert scores == {"gsm8k": (3, 3), "math500": (3, 2), "humaneval": (3, 3), "mbpp": (3, 2)}
    assert summary["engine_settings"] == {"threshold": 0.85, "block_length": 32}
    assert summary["run"]["edit_threshold"] == 0.5 and summary["device"] == "cpu"
    for name in ("gsm8k", "math500", "humaneval", "mbpp"):
        assert len((out / f"{name}.jsonl").read_text().splitlines()) == 3
    files = {b["name"]: b["file"] for b in summary["benchmarks"]}
    assert all(files[name].endswith(f"{name}.jsonl") for name in files)

    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0, second.output
    assert len(llm.calls) == 12  # nothing generated again
    assert json.loads((out / "summary.json").read_text())["benchmarks"] == summary["benchmarks"]

    other = CliRunner().invoke(main, [*args[:-2], "--seed", "7", "--out", str(out)])
    assert other.exit_code != 0 and "seed=0" in other.output
    pinned = CliRunner().invoke(main, [*args[:-2], "--revision", "v1", "--out", str(out)])
    assert pinned.exit_code != 0 and "revision=None" in pinned.output  # another checkpoint


def test_cli_revision_reaches_the_engine_and_the_run_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gsm8k_rows: list[dict[str, Any]],
) -> None:
    llm, loads = FakeLLM(gsm8k_rows[:1]), []
    monkeypatch.setattr("dlmc.cli.bench._load_llm", lambda *args: loads.append(args) or llm)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench", "suite", "-m", "acme/dlm", "--revision", "v1",
                                       "--limit", "1", "-p", "gsm8k", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert loads == [("acme/dlm", "orl", "auto", None, "auto", "v1")]
    assert json.loads((out / "run.json").read_text())["revision"] == "v1"


def test_cli_reports_an_unknown_file_format(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    result = CliRunner().invoke(main, ["bench", "suite", "-m", "fake", "-p", str(path),
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and "cannot tell which benchmark" in result.output
    assert "Traceback" not in result.output


def test_bench_help_lists_suite() -> None:
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0 and "suite" in result.output


def test_a_looping_or_allocating_solution_does_not_harm_the_run(
    data_dir: Path, tmp_path: Path, humaneval_rows: list[dict[str, Any]]
) -> None:
    rows = humaneval_rows[:4]
    loop = "```python\n" + rows[1]["prompt"] + "    while True:\n        pass\n```"
    bomb = "```python\nx = []\nwhile True:\n    x.append(bytearray(2**26))\n```"
    llm = FakeLLM(rows, overrides={key_of(rows[1]): loop, key_of(rows[2]): bomb})
    problems = load_problem_set(str(data_dir / "humaneval.jsonl"), limit=4)
    plan, shots = plan_prompts(problems, "chat", False)
    settings = SuiteSettings(max_new_tokens=64, code_timeout_s=5.0, code_memory_mb=512)
    summary = run_benchmark(llm, problems, plan, shots, settings, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "humaneval.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in records] == [True, False, False, True]
    assert "timed out" in records[1]["reason"] and "MemoryError" in records[2]["reason"]
    assert (summary.problems, summary.correct) == (4, 2)


def test_report_table_shows_the_numbers() -> None:
    from rich.console import Console

    from dlmc.bench.prompts import PromptPlan
    from dlmc.bench.records import BenchmarkSummary
    from dlmc.bench.report import render_report

    plan = PromptPlan(0, "none", "chat", "{question}", "last number")
    summary = BenchmarkSummary("gsm8k", "g.jsonl", "all 3 rows", problems=3, correct=2,
                               forwards=40, tokens=100, seconds=4.0, plan=plan, checker="numeric",
                               extractor_counts={"last_number": 3})
    console = Console(width=80, record=True)
    console.print(render_report([summary], {"model": "m", "role": "orl"}, "cuda:0 (H200)",
                                {"threshold": 0.85, "block_length": 32}))
    text = console.export_text()
    assert "66.7" in text and "2.50" in text and "25.0" in text  # accuracy %, TPF, tokens/s
    assert "threshold=0.85" in text and "cuda:0 (H200)" in text and "last_number 3" in text
