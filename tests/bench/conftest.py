"""Shared fixtures for the bench tests: the benchmark files in ../shared/data (beside the repo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

DATA_DIR = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data").resolve()


def _rows(name: str) -> list[dict[str, Any]]:
    path = DATA_DIR / name
    if not path.is_file():
        pytest.skip(f"benchmark data not found at {path} (clone the repo beside shared/)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The directory with gsm8k.jsonl, math500.jsonl, humaneval.jsonl, mbpp.jsonl."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"benchmark data not found at {DATA_DIR} (clone the repo beside shared/)")
    return DATA_DIR


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict[str, Any]]:
    return _rows("gsm8k.jsonl")


@pytest.fixture(scope="session")
def math_rows() -> list[dict[str, Any]]:
    return _rows("math500.jsonl")


@pytest.fixture(scope="session")
def humaneval_rows() -> list[dict[str, Any]]:
    return _rows("humaneval.jsonl")


@pytest.fixture(scope="session")
def mbpp_rows() -> list[dict[str, Any]]:
    return _rows("mbpp.jsonl")
