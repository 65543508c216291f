"""dlmc::canvas_propose: DiffusionGemma's chunked proposal against the torch maths.

On CPU the kernels run under Triton's interpreter. The argmax and the self-conditioning input
are the reference's bit for bit (the same IEEE division and bf16 rounding); the sample is
`argmax(t - log noise)` instead of `argmax(softmax(t) / noise)` (the same order in real
arithmetic: equal unless two candidates tie to the last bit); the entropy differs in the order
of its fp32 sums.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.canvas_propose import CHUNK, canvas_propose, canvas_propose_reference

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lead: tuple[int, ...], vocab: int, seed: int, cap: float = 30.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft-capped logits (`cap * tanh(x / cap)`, as the model's), Exp(1) noise, a temperature."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, vocab, generator=gen) * 6
    logits = (cap * torch.tanh(x / cap)).to(DEVICE)
    noise = torch.empty(*lead, vocab).exponential_(1.0, generator=gen).to(DEVICE)
    temp = torch.tensor(0.4 + 0.4 * torch.rand((), generator=gen).item(), device=DEVICE)
    return logits, noise, temp


def run_both(logits, noise, temp, sc_dtype, keep, seed: int):
    sc = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)).to(
        device=DEVICE, dtype=sc_dtype)
    want_sc = sc.clone()
    got = canvas_propose(logits, noise, temp, sc, keep)
    want = canvas_propose_reference(logits, noise, temp, want_sc, keep)
    return got, want, sc, want_sc


def assert_proposal(got, want, sc, want_sc) -> None:
    for g, w, dtype in zip(got, want, (torch.int64, torch.int64, torch.float32), strict=True):
        assert g.shape == w.shape and g.dtype == dtype
    assert torch.equal(got[0], want[0]), "sample"
    assert torch.equal(got[1], want[1]), "argmax"
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=2e-5)
    assert torch.equal(sc, want_sc), "sc_out"


@settings(max_examples=25, deadline=None)
@given(lead=st.sampled_from([(1,), (5,), (2, 3)]),
       vocab=st.sampled_from([7, 1000, CHUNK, CHUNK + 1, 2 * CHUNK + 300]),
       sc_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       keep=st.sampled_from(["none", "all", "some"]), seed=st.integers(0, 2**16))
def test_matches_reference(lead, vocab, sc_dtype, keep, seed) -> None:
    logits, noise, temp = make_case(lead, vocab, seed)
    groups = lead[:-1]
    keep_mask = {"none": None, "all": torch.ones(groups, dtype=torch.bool),
                 "some": torch.arange(len(groups) and groups[0] or 1).reshape(groups) % 2 == 1
                 }[keep]
    if keep_mask is not None:
        keep_mask = keep_mask.to(DEVICE)
    assert_proposal(*run_both(logits, noise, temp, sc_dtype, keep_mask, seed))


def test_kept_rows_and_written_rows() -> None:
    """Group 0 stopped: its rows of `sc_out` are untouched; group 1's are `logits / temp`."""
    logits, noise, temp = make_case((2, 3), 500, 1)
    keep = torch.tensor([True, False], device=DEVICE)
    _, _, sc, _ = run_both(logits, noise, temp, torch.float32, keep, 1)
    before = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(sc[0], before[0])
    assert torch.equal(sc[1], logits[1] / temp)


def test_ties_go_to_the_lowest_index_across_chunks() -> None:
    """Equal logits everywhere: the argmax is 0; equal maxima of the sample's key in two chunks
    (noise 1 except two equal small draws): the first of them."""
    vocab = 2 * CHUNK + 5
    logits = torch.zeros(1, vocab, device=DEVICE)
    noise = torch.ones(1, vocab, device=DEVICE)
    noise[0, CHUNK + 3] = noise[0, 2 * CHUNK + 1] = 0.25
    sc = torch.empty(1, vocab, device=DEVICE)
    sample, argmax, entropy = canvas_propose(logits, noise, torch.tensor(0.5, device=DEVICE), sc)
    assert int(argmax[0]) == 0 and int(sample[0]) == CHUNK + 3
    assert entropy[0].item() == pytest.approx(torch.log(torch.tensor(float(vocab))).item(),
                                              rel=1e-6)


def test_a_peaked_row_has_the_reference_entropy() -> None:
    """One logit far above the rest: the entropy is tiny and still the reference's."""
    logits, noise, temp = make_case((4,), 3000, 2)
    logits[:, 17] = 29.0
    got, want, sc, want_sc = run_both(logits, noise, temp, torch.bfloat16, None, 2)
    assert_proposal(got, want, sc, want_sc)
    assert (got[1] == 17).all() and (got[2] < 1e-3).all()


def test_bad_inputs_name_the_tensor() -> None:
    logits, noise, temp = make_case((3,), 64, 3)
    sc = torch.empty_like(logits)
    with pytest.raises(ValueError, match=r"logits must be contiguous fp32 \[\.\.\., C, V\]"):
        canvas_propose(logits.double(), noise, temp, sc)
    with pytest.raises(ValueError, match="exponential must be contiguous torch.float32"):
        canvas_propose(logits, noise[:, :32], temp, sc)
    with pytest.raises(ValueError, match="sc_out must be contiguous torch.bfloat16 or"):
        canvas_propose(logits, noise, temp, sc.half())
    with pytest.raises(ValueError, match=r"temp must be a fp32 \[\] tensor"):
        canvas_propose(logits, noise, temp[None], sc)
    with pytest.raises(ValueError, match=r"sc_keep must be bool \(\)"):
        canvas_propose(logits, noise, temp, sc, torch.zeros(3, dtype=torch.bool, device=DEVICE))


def test_opcheck() -> None:
    logits, noise, temp = make_case((2, 3), 50, 4)
    sc = torch.empty(logits.shape, dtype=torch.bfloat16, device=DEVICE)
    torch.library.opcheck(torch.ops.dlmc.canvas_propose.default,
                          (logits, noise, temp, sc, torch.tensor([True, False], device=DEVICE)),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_full_canvas_compiled_and_replayed() -> None:
    """DiffusionGemma's shape (256 x 262144, bf16 self-conditioning): eager, then compiled and
    captured (the op traced by Inductor, `sc_out` mutated inside the graph), equal to the
    reference on new inputs at every replay."""
    logits, noise, temp = make_case((256,), 262144, 5)
    assert_proposal(*run_both(logits, noise, temp, torch.bfloat16, None, 5))
    sc = torch.zeros(logits.shape, dtype=torch.bfloat16, device=DEVICE)
    keep = torch.zeros((), dtype=torch.bool, device=DEVICE)
    graph, out = compile_and_capture(
        lambda lg, nz, tp, kp: canvas_propose(lg, nz, tp, sc, kp), logits, noise, temp, keep)
    for seed in (6, 7):
        case = make_case((256,), 262144, seed)
        for buffer, value in zip((logits, noise, temp), case, strict=True):
            buffer.copy_(value)
        want_sc = sc.clone()
        want = canvas_propose_reference(logits, noise, temp, want_sc, keep)
        graph.replay()
        assert_proposal(out, want, sc, want_sc)
    keep.fill_(True)
    kept = sc.clone()
    graph.replay()
    assert torch.equal(sc, kept)
