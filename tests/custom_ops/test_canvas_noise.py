"""dlmc::canvas_step_noise: the draws of eager decoding (transformers' calls and order), eager,
compiled and graph-replayed, from the default generator."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.canvas_noise import canvas_step_noise, canvas_step_noise_reference
from dlmc.graphs.canvas_rules import draw_step_noise

from .graph_capture import compile_and_capture


def _sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's use of the draws: the categorical sample, then the re-noised canvas."""
    exponential, renoise = canvas_step_noise(logits)
    sample = torch.argmax(torch.softmax(logits, -1) / exponential, dim=-1)  # [C]
    return torch.where(sample % 3 == 0, sample, renoise), exponential


@pytest.mark.parametrize("shape", [(8, 128), (2, 5, 33)])
def test_draws_equal_the_eager_draws_of_the_default_generator(shape):
    logits = torch.randn(shape, dtype=torch.bfloat16)
    torch.manual_seed(3)
    exponential, renoise = canvas_step_noise(logits)
    after = torch.rand(4)  # the generator was advanced as much as by the eager draws
    want = draw_step_noise(shape[:-1], shape[-1], torch.Generator().manual_seed(3), "cpu")
    assert exponential.dtype == torch.float32 and exponential.shape == shape
    assert renoise.dtype == torch.int64 and renoise.shape == shape[:-1]
    assert torch.equal(exponential, want.exponential) and torch.equal(renoise, want.renoise_ids)
    gen = torch.Generator().manual_seed(3)
    reference = canvas_step_noise_reference(logits, gen)
    assert torch.equal(reference[0], exponential) and torch.equal(reference[1], renoise)
    assert torch.equal(after, torch.rand(4, generator=gen))
    assert (exponential > 0).all() and renoise.min() >= 0 and renoise.max() < shape[-1]


def test_compiled_draws_equal_eager_draws(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    logits = torch.randn(6, 50)
    torch.manual_seed(0)
    want = _sample(logits)
    after = torch.rand(3)
    torch.manual_seed(0)
    got = torch.compile(_sample, fullgraph=True, dynamic=False)(logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(torch.rand(3), after)


def test_op_registration():
    op = torch.ops.dlmc.canvas_step_noise.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    torch.library.opcheck(op, (torch.randn(4, 9),),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


@pytest.mark.gpu
def test_graph_replays_draw_what_eager_draws(tmp_path, monkeypatch):
    """Each replay of a captured draw equals an eager draw from the same generator state and
    advances the default CUDA generator as much."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    logits = torch.randn(16, 1000, device="cuda")
    graph, outputs = compile_and_capture(_sample, logits)
    torch.cuda.manual_seed(7)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(tuple(t.clone() for t in outputs))
    after = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(7)
    for got in replays:
        want = _sample(logits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(torch.rand(5, device="cuda"), after)
