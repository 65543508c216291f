"""Problem files: benchmark recognition, subsets, limits and errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlmc.bench.problems import load_problem_set, parse_problem_spec
from dlmc.errors import ConfigError


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
    with pytest.raises(ConfigError, match="not found"):
        load_problem_set(str(tmp_path / "missing.jsonl"))
