"""Problem files: benchmark recognition, subsets, limits and errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlmc.bench.problems import load_problem_set, packaged_file, parse_problem_spec, read_jsonl
from dlmc.cli import main
from dlmc.errors import ConfigError

NAMES = ("gsm8k", "math500", "humaneval", "mbpp")


@pytest.mark.parametrize(("file", "bench_name", "count", "first_id"), [
    ("gsm8k.jsonl", "gsm8k", 1319, "row-0"),
    ("math500.jsonl", "math500", 500, "test/precalculus/807.json"),
    ("humaneval.jsonl", "humaneval", 164, "HumanEval/0"),
    ("mbpp.jsonl", "mbpp", 500, "11"),
])
def test_benchmarks_are_recognised_from_their_fields(
    data_dir: Path, file: str, bench_name: str, count: int, first_id: str
) -> None:
    problems = load_problem_set(str(data_dir / file))
    assert problems.benchmark == bench_name
    assert len(problems.problems) == count
    assert problems.problems[0].id == first_id
    assert len({p.id for p in problems.problems}) == count


def test_mbpp_uses_the_test_split_and_keeps_the_exemplar_pool(data_dir: Path) -> None:
    mbpp = load_problem_set(str(data_dir / "mbpp.jsonl"))
    ids = [p.row["task_id"] for p in mbpp.problems]
    assert ids == list(range(11, 511)) and "11-510" in mbpp.subset
    assert len(mbpp.all_rows) == 974


def test_limit_and_named_spec(data_dir: Path) -> None:
    problems = load_problem_set(f"humaneval={data_dir / 'humaneval.jsonl'}", limit=3)
    assert [p.id for p in problems.problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "first 3" in problems.subset
    assert parse_problem_spec("MATH=x.jsonl") == ("math500", Path("x.jsonl"))
    assert parse_problem_spec("weird=name.jsonl") == (None, Path("weird=name.jsonl"))
    with pytest.raises(ConfigError, match="--limit"):
        load_problem_set(str(data_dir / "gsm8k.jsonl"), limit=0)


def test_unknown_format_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"prompt_text": "x", "label": 1}) + "\n")
    with pytest.raises(ConfigError, match="cannot tell which benchmark") as info:
        load_problem_set(str(path))
    assert str(path) in str(info.value) and "gsm8k=" in str(info.value)


def test_bad_rows_name_the_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n')
    with pytest.raises(ConfigError, match=r"row 2 lacks field\(s\) \['answer'\]"):
        load_problem_set(str(path))
    path.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"g\.jsonl:2: not valid JSON"):
        load_problem_set(str(path))
    with pytest.raises(ConfigError, match="--problems .*missing.jsonl.*no such file"):
        load_problem_set(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize(("spec", "bench_name", "count"), [
    ("gsm8k", "gsm8k", 1319), ("math500", "math500", 500), ("humaneval", "humaneval", 164),
    ("mbpp", "mbpp", 500), ("MATH", "math500", 500), ("human-eval", "humaneval", 164),
])
def test_a_name_loads_the_packaged_file(
    data_dir: Path, spec: str, bench_name: str, count: int
) -> None:
    named = load_problem_set(spec)
    by_path = load_problem_set(str(data_dir / f"{bench_name}.jsonl"))
    assert (named.benchmark, len(named.problems)) == (bench_name, count)
    assert [p.row for p in named.problems] == [p.row for p in by_path.problems]
    assert named.path.name == f"{bench_name}.jsonl" and named.subset == by_path.subset


def test_a_local_file_named_like_a_benchmark_is_reached_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("gsm8k").write_text('{"question": "q", "answer": "#### 7"}\n')
    assert len(load_problem_set("gsm8k").problems) == 1319  # the name: the packaged file
    assert [p.row["answer"] for p in load_problem_set("./gsm8k").problems] == ["#### 7"]
    assert len(load_problem_set("gsm8k=gsm8k").problems) == 1


@pytest.mark.parametrize("spec", ["gsm9k", "mbpp=nowhere.jsonl", "missing/dir/", "weird=x"])
def test_an_unknown_name_or_missing_file_is_one_line_naming_the_option(
    tmp_path: Path, spec: str
) -> None:
    result = CliRunner().invoke(main, ["bench", "suite", "-m", "fake", "--problems", spec,
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: --problems {spec}: no such file")
    assert all(name in lines[0] for name in NAMES)
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_a_missing_exemplar_file_is_one_line_naming_its_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "suite", "-m", "fake", "-p", "gsm8k", "--few-shot",
                                       "--exemplars", "gsm8k=nowhere.jsonl",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "Error: --exemplars gsm8k=nowhere.jsonl: no such file 'nowhere.jsonl'"]


def test_packaged_files_are_read_through_importlib_resources() -> None:
    for name in NAMES:
        file = packaged_file(name)
        assert file.is_file() and file.name == f"{name}.jsonl"
    assert len(read_jsonl(packaged_file("mbpp"))) == 974
    with pytest.raises(ConfigError, match="names: gsm8k, math500, humaneval, mbpp"):
        packaged_file("gsm9k")
