"""Shared test set-up: Triton kernels run under the CPU interpreter when no GPU is present, and
every cache the tests fill (Inductor's, Triton's, Hypothesis's, dlmc's built-in models, the
temporary files) lives in a temporary directory of this process that is removed when it exits."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Before torch is imported, so that Inductor and Triton never write to their default
# directories (/tmp/torchinductor_<user>, ~/.triton). Subprocesses of tests inherit them.
_CACHES = tempfile.mkdtemp(prefix="dlmc-tests-")
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
for _name, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                    ("DLMC_CACHE", "dlmc"), ("HYPOTHESIS_STORAGE_DIRECTORY", "hypothesis"),
                    ("TMPDIR", "tmp")):
    os.environ[_name] = os.path.join(_CACHES, _sub)
# Inductor's precompiled headers and pytest's tmp_path live under the temporary directory.
os.makedirs(os.environ["TMPDIR"])
tempfile.tempdir = os.environ["TMPDIR"]

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402 (after the cache directories are set)
from hypothesis import Phase, settings  # noqa: E402

# No .hypothesis/ folder in the checkout. On a GPU a failing example is reported as found, not
# shrunk: shrinking reruns the kernels for up to minutes, which a GPU test part's time limit
# would spend before the example is printed.
_SKIPPED_PHASES = (Phase.shrink, Phase.explain) if _HAS_CUDA else ()
settings.register_profile("dlmc", database=None,
                          phases=tuple(p for p in Phase if p not in _SKIPPED_PHASES))
settings.load_profile("dlmc")


def _interpret_without_overflow_asserts() -> None:
    """Triton's interpreter checks every int32 add/sub/mul for overflow (a device_assert the
    compiled kernels drop): about half of a kernel test's CPU time, on shapes far too small
    to overflow. DLMC_TEST_SANITIZE_OVERFLOW=1 keeps the checks."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    if os.environ.get("DLMC_TEST_SANITIZE_OVERFLOW", "0") == "1":
        return
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


_interpret_without_overflow_asserts()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: perf/gpu.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny llada2_moe checkpoint (sharded, with tokenizer) written by dlmc's generator."""
    from dlmc.loading.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llada2"), seed=0)


@pytest.fixture(scope="session")
def nvfp4_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny NVFP4 checkpoint in the ModelOpt format (exported from a tiny BF16 one, FP8 KV
    scales 0.5 / 0.25). Tests copy it before they change it."""
    from dlmc.loading.tiny import write_tiny_checkpoint
    from dlmc.quant.export import export_nvfp4

    src = write_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), seed=4, shards=1)
    out = tmp_path_factory.mktemp("nvfp4")
    export_nvfp4(src, out, kv_scales={layer: (0.5, 0.25) for layer in range(3)})
    return out


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The tiny checkpoint loaded in fp32 on the CPU."""
    from dlmc import LLM

    return LLM(tiny_dir, device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny diffusion_gemma checkpoint (sharded, with tokenizer) written by dlmc's generator."""
    from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint

    return write_tiny_gemma_checkpoint(tmp_path_factory.mktemp("tiny-diffusiongemma"), seed=0)


@pytest.fixture(scope="session")
def tiny_gemma_llm(tiny_gemma_dir):
    """The tiny DiffusionGemma checkpoint loaded in fp32 on the CPU (eager canvas steps)."""
    from dlmc import LLM

    return LLM(tiny_gemma_dir, device="cpu", dtype="fp32")
