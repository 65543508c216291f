"""The repository's layout rules, read from the source with `ast` (docs/architecture.md):
imports flow one way between the layers, no import loops, every cited doc exists, and no module
reads a `DLMC_*` setting other than `DLMC_CACHE`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package roots: the top-level `custom_ops/` and `graphs/` are `dlmc.custom_ops`, `dlmc.graphs`.
SOURCES = {ROOT / "src" / "dlmc": "dlmc", ROOT / "custom_ops": "dlmc.custom_ops",
           ROOT / "graphs": "dlmc.graphs"}
# The layers, lowest first: a module may import its own layer's modules and lower layers only.
LAYERS = (
    ("dlmc.errors", "dlmc.cache_dir"),
    ("dlmc.quant",),
    ("dlmc.custom_ops",),
    ("dlmc.models",),
    ("dlmc.kv",),
    ("dlmc.loading",),
    ("dlmc.graphs",),
    ("dlmc.engine",),
    ("dlmc.results",),
    ("dlmc.api",),
    ("dlmc.server", "dlmc.bench"),
    ("dlmc",),  # the package's own __init__: `from dlmc import LLM, KernelConfig`
    ("dlmc.cli",),
    ("dlmc.__main__",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for root, package in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The dlmc modules `path` imports anywhere (module level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def layer(module: str) -> str:
    """The layer a module belongs to: the longest layer name that is a prefix of it."""
    best = max((name for name in RANK if module == name or module.startswith(name + ".")),
               key=len)
    return best


GRAPH = {name: imports(path, set(modules())) - {name} for name, path in modules().items()}


def test_every_module_has_a_layer() -> None:
    assert {"dlmc.api", "dlmc.graphs.round", "dlmc.kv.paged_cache"} <= set(GRAPH)
    for module in GRAPH:
        assert layer(module) in RANK


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_flow_one_way(module: str) -> None:
    """custom_ops <- models <- KV cache <- graphs <- the block decoder <- api <- cli/server/bench:
    no module imports a higher layer or a sibling layer."""
    mine = layer(module)
    wrong = sorted(dep for dep in GRAPH[module]
                   if layer(dep) != mine and RANK[layer(dep)] >= RANK[mine])
    assert not wrong, f"{module} ({mine}) imports {wrong}"


def test_no_import_loops() -> None:
    """The module import graph is acyclic (imports inside functions count too)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                loop = path[path.index(dep):] + [dep]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def tracked_text_files() -> list[Path]:
    roots = [ROOT / "src", ROOT / "custom_ops", ROOT / "graphs", ROOT / "tests", ROOT / "perf"]
    files = [p for r in roots for p in r.rglob("*") if p.suffix in (".py", ".sh", ".md")]
    return [*files, ROOT / "README.md", ROOT / "pyproject.toml"]


def test_cited_docs_exist() -> None:
    """Every `docs/....md` path named in the code, tests, perf/ and the README exists."""
    cited = {m for path in tracked_text_files()
             for m in re.findall(r"\bdocs/[\w./-]*\w\.md", path.read_text(errors="replace"))}
    assert cited, "no doc is cited at all: the pattern is wrong"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but missing: {missing}"


def test_no_environment_switches() -> None:
    """No module of the package names a `DLMC_*` setting other than `DLMC_CACHE`, which only
    `dlmc.cache_dir` reads, and `dlmc serve`'s secret `DLMC_API_KEY` (the value of its
    `--api-key` option, which click reads when the command runs, kept out of the process
    list)."""
    for name, path in modules().items():
        text = path.read_text()
        names = set(re.findall(r"DLMC_[A-Z0-9_]+", text))
        allowed = {"DLMC_CACHE"} | ({"DLMC_API_KEY"} if name == "dlmc.cli.serve" else set())
        assert names <= allowed, f"{name} names {sorted(names)}"
        keys = {node.value for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Constant)
                and isinstance(node.value, str) and node.value.startswith("DLMC_")}
        assert keys <= allowed - {"DLMC_CACHE"} or name == "dlmc.cache_dir", (
            f"{name} reads {sorted(keys)}")
