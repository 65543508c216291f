"""pyproject.toml lists every package (setuptools maps them explicitly) and ships the data files."""

import hashlib
import re
import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PROBLEM_FILES = ("gsm8k.jsonl", "math500.jsonl", "humaneval.jsonl", "mbpp.jsonl")


def _package_dirs() -> dict[str, Path]:
    """Every package directory (one with an ``__init__.py``) under the mapped folders."""
    found = {}
    for package, folder in CONFIG["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([package, *rel.parts])] = init.parent
    return found


def test_all_packages_listed():
    found = set(_package_dirs())
    listed = set(CONFIG["packages"])
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"


def test_every_data_file_of_the_data_package_is_package_data():
    # setuptools installs only .py files of a listed package unless package-data names the rest.
    folder = _package_dirs()["dlmc.bench.data"]
    globs = CONFIG["package-data"]["dlmc.bench.data"]
    data = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".py")
    assert set(data) >= {*PROBLEM_FILES, "SOURCES.md", "LICENSES.md"}
    assert [name for name in data if not any(fnmatch(name, g) for g in globs)] == []


def test_problem_files_are_installed_and_match_their_recorded_checksums():
    package = resources.files("dlmc.bench.data")
    sources = package.joinpath("SOURCES.md").read_text(encoding="utf-8")
    recorded = dict(re.findall(r"^\| (\w+\.jsonl) \| \d+ \| [\d,]+ \| `([0-9a-f]{64})` \|$",
                               sources, flags=re.MULTILINE))
    assert sorted(recorded) == sorted(PROBLEM_FILES)
    for name in PROBLEM_FILES:
        digest = hashlib.sha256(package.joinpath(name).read_bytes()).hexdigest()
        assert digest == recorded[name], name
    licences = package.joinpath("LICENSES.md").read_text(encoding="utf-8")
    assert licences.count("MIT License") == 3 and "CC-BY-4.0" in licences
