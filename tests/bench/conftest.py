"""Shared fixtures for the bench tests: the benchmark files shipped in `dlmc.bench.data`."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from dlmc.bench.problems import DATA_PACKAGE, packaged_file, read_jsonl


@pytest.fixture(scope="session")
def data_dir() -> Iterator[Path]:
    """The directory with gsm8k.jsonl, math500.jsonl, humaneval.jsonl, mbpp.jsonl (as paths, the
    way a user passes their own files)."""
    with resources.as_file(resources.files(DATA_PACKAGE)) as path:
        yield path


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict[str, Any]]:
    return read_jsonl(packaged_file("gsm8k"))


@pytest.fixture(scope="session")
def math_rows() -> list[dict[str, Any]]:
    return read_jsonl(packaged_file("math500"))


@pytest.fixture(scope="session")
def humaneval_rows() -> list[dict[str, Any]]:
    return read_jsonl(packaged_file("humaneval"))


@pytest.fixture(scope="session")
def mbpp_rows() -> list[dict[str, Any]]:
    return read_jsonl(packaged_file("mbpp"))
