"""The paged attention's fused merge: the split kernel's programs meet at a barrier and merge.

Its results against the reference are in the variant tests (`ilv32-fused` and the fuzz's
`fused_merge`); here: when it applies, that it replaces the merge launch, equals the two-launch
merge bit for bit, and leaves its counters at zeros across CUDA-graph replays.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlmc.custom_ops._paged_attention_launch import (
    SWEEP_VARIANTS,
    fused_merge_applies,
    fused_merge_rows,
    launch_paged_attention,
)

from .paged_attention_cases import make_case

FUSED = SWEEP_VARIANTS["ilv32-fused"]


def test_fused_merge_applies_only_with_a_barrier_compiled_on_cuda() -> None:
    barrier = torch.zeros(8, dtype=torch.int32)
    cpu = torch.device("cpu")
    assert not fused_merge_applies(FUSED, barrier, 132, cpu)  # the interpreter: one by one
    assert not fused_merge_applies(FUSED, None, 132, cpu)
    assert not fused_merge_applies(SWEEP_VARIANTS["ilv32"], barrier, 132, cpu)


def test_fused_merge_rows_cover_every_row() -> None:
    # LLaDA2.1-mini: 32 queries x 4 heads per KV head = 64 rows, 33 programs per KV head
    assert fused_merge_rows(64, 33) == 2
    for rows, programs in ((64, 33), (1, 9), (128, 8), (96, 33), (5, 5), (256, 3)):
        per = fused_merge_rows(rows, programs)
        assert per & (per - 1) == 0 and per * programs >= rows, (rows, programs, per)


def _kernel_names(fn) -> list[str]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300])
def test_fused_merge_is_one_launch_equal_to_two(window: int | None) -> None:
    """LLaDA2.1-mini's shapes (FP8, D=128, 32 splits): one launch, the same bits as the split
    kernel + flat merge, the counters back at zeros after eager calls and graph replays."""
    case = make_case(num_queries=32, num_q_heads=16, num_kv_heads=4, head_dim=128,
                     page_size=16, prefix=3000, k_scale=0.03, v_scale=0.02, seed=4)
    barrier = torch.zeros(8, dtype=torch.int32, device="cuda")
    args = (*case.values(), 128**-0.5, window or 0, 0, 0)
    unfused = dataclasses.replace(FUSED, fused_merge=False)
    names = _kernel_names(lambda: launch_paged_attention(*args, FUSED, barrier=barrier))
    assert [n for n in names if "paged_attention" in n] == ["paged_attention_split_kernel"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_paged_attention(*args, FUSED, barrier=barrier)
    for prefix in (0, 1, 63, 64, 1000, 3000):
        case["prefix_len"].fill_(prefix)
        eager = launch_paged_attention(*args, FUSED, barrier=barrier)
        assert not barrier.any(), barrier
        graph.replay()
        assert not barrier.any(), barrier
        want = launch_paged_attention(*args, unfused)
        assert torch.equal(eager, want), prefix
        assert torch.equal(out, want), prefix
