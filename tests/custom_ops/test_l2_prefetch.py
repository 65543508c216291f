"""`l2_prefetch` and the down kernel's `PREFETCH` (`DLMC_NVFP4_DOWN_PREFETCH`): a hint only, so
every output must be bit for bit the same with it as without it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import dlmc.custom_ops.nvfp4_moe as nvfp4_module
from dlmc.custom_ops.l2_prefetch import l2_prefetch
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe
from dlmc.custom_ops.nvfp4_words import stored_forms
from tests.custom_ops.test_nvfp4_moe import DEVICE, op_args, random_experts, random_routing


@triton.jit
def _copy_and_prefetch(x_ptr, y_ptr, w_ptr, nbytes, n, PREFETCH: tl.constexpr,
                       INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
    l2_prefetch(w_ptr, nbytes, tl.program_id(0), tl.num_programs(0),
                PREFETCH and not INTERPRETED)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


@pytest.mark.parametrize("nbytes", [0, 15, 16, 4096 + 8, 3 << 20])
def test_a_kernel_that_prefetches_computes_the_same(nbytes: int) -> None:
    """Ranges of no whole 16-byte unit, a tail, and more than a program's 64 KB piece; the
    weight is never written."""
    from dlmc.custom_ops._registration import INTERPRETED

    x = torch.randn(1000, device=DEVICE)
    w = torch.randn(max(nbytes // 4, 1), device=DEVICE)
    w_before = w.clone()
    y = torch.empty_like(x)
    _copy_and_prefetch[(8,)](x, y, w, nbytes, 1000, PREFETCH=True, INTERPRETED=INTERPRETED,
                             BLOCK=128)
    assert torch.equal(y, x * 2.0)
    assert torch.equal(w, w_before)


def experts_case(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int,
                 inter: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    for proj in ("gate", "up", "down"):
        experts[f"{proj}_weight"], experts[f"{proj}_weight_scale"] = stored_forms(
            experts[f"{proj}_weight"], experts[f"{proj}_weight_scale"], 7)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew=False)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    return tuple(t.to(DEVICE) for t in op_args(x, ids, w, experts))


def with_and_without(monkeypatch: pytest.MonkeyPatch, args: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(nvfp4_module, "_DOWN_PREFETCH", False)
    plain = nvfp4_moe(*args)
    monkeypatch.setattr(nvfp4_module, "_DOWN_PREFETCH", True)
    return plain, nvfp4_moe(*args)


def test_down_prefetch_gives_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter the prefetch is off but its expert lookup runs (unused and
    partial blocks included)."""
    plain, prefetched = with_and_without(monkeypatch, experts_case(3, 5, 6, 2, 256, 128))
    assert torch.equal(plain.view(torch.int16), prefetched.view(torch.int16))


def test_bad_switch_value_is_named() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "import dlmc.custom_ops.nvfp4_moe"],
                            env={**__import__("os").environ, "DLMC_NVFP4_DOWN_PREFETCH": "yes"},
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "DLMC_NVFP4_DOWN_PREFETCH must be 0 or 1" in result.stderr


@pytest.mark.gpu
def test_down_prefetch_gives_the_same_output_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaDA2.1-mini's expert shapes, a block of 32 tokens x top-8, eager and graph-replayed."""
    args = experts_case(5, 32, 256, 8, 2048, 512)
    plain, prefetched = with_and_without(monkeypatch, args)
    assert torch.equal(plain.view(torch.int16), prefetched.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = nvfp4_moe(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plain.view(torch.int16), replayed.view(torch.int16))
