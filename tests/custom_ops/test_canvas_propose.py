"""dlmc::canvas_propose: DiffusionGemma's chunked proposal against the torch maths.

On CPU the kernels run under Triton's interpreter. The argmax and the self-conditioning input
are the reference's bit for bit (the same IEEE division and bf16 rounding); the sample is
`argmax(t - log noise)` instead of `argmax(softmax(t) / noise)` (the same order in real
arithmetic: equal unless two candidates tie to the last bit); the entropy differs in the order
of its fp32 sums. With `softcap` (the op caps the lm_head's output itself) the capped values
come from another tanh than PyTorch's and may differ in their last bit: the self-conditioning
input is compared to a bf16 / fp32 rounding step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.canvas_propose import (
    CHUNK,
    DEFAULT_TILES,
    ProposeTiles,
    canvas_propose,
    canvas_propose_reference,
)

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lead: tuple[int, ...], vocab: int, seed: int, cap: float = 30.0,
              raw: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft-capped logits (`cap * tanh(x / cap)`, as the model's), or with `raw` the values
    before the cap in that dtype; Exp(1) noise; a temperature."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, vocab, generator=gen) * 6
    logits = (x.to(raw) if raw else cap * torch.tanh(x / cap)).to(DEVICE)
    noise = torch.empty(*lead, vocab).exponential_(1.0, generator=gen).to(DEVICE)
    temp = torch.tensor(0.4 + 0.4 * torch.rand((), generator=gen).item(), device=DEVICE)
    return logits, noise, temp


# the default split, and smaller chunks and tiles
TILES = [DEFAULT_TILES, ProposeTiles(chunk=2048, block=512, num_warps=8),
         ProposeTiles(chunk=4096, block=256, num_warps=2)]


def run_both(logits, noise, temp, sc_dtype, keep, seed: int, softcap: float = 0.0,
             tiles: ProposeTiles = DEFAULT_TILES):
    sc = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)).to(
        device=DEVICE, dtype=sc_dtype)
    want_sc = sc.clone()
    got = canvas_propose(logits, noise, temp, sc, keep, softcap, tiles)
    want = canvas_propose_reference(logits, noise, temp, want_sc, keep, softcap)
    return got, want, sc, want_sc


def assert_proposal(got, want, sc, want_sc, exact_sc: bool = True) -> None:
    for g, w, dtype in zip(got, want, (torch.int64, torch.int64, torch.float32), strict=True):
        assert g.shape == w.shape and g.dtype == dtype
    assert torch.equal(got[0], want[0]), "sample"
    assert torch.equal(got[1], want[1]), "argmax"
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=2e-5)
    if exact_sc:
        assert torch.equal(sc, want_sc), "sc_out"
    else:  # one rounding step of sc's dtype, and few elements off at all (the cap's tanh
        # is the interpreter's numpy or the GPU's libdevice against torch's: an ulp apart on
        # a few percent of the values)
        step = 2.0**-7 if sc.dtype == torch.bfloat16 else 2.0**-21
        torch.testing.assert_close(sc.float(), want_sc.float(), rtol=step, atol=1e-6)
        assert (sc != want_sc).float().mean().item() < 5e-2, "sc_out"


@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (5,), (2, 3)]),
       vocab=st.sampled_from([7, 1000, CHUNK, CHUNK + 1, 2 * CHUNK + 300]),
       sc_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       keep=st.sampled_from(["none", "all", "some"]),
       raw=st.sampled_from([None, torch.bfloat16, torch.float32]), tiles=st.sampled_from(TILES),
       seed=st.integers(0, 2**16))
def test_matches_reference(lead, vocab, sc_dtype, keep, raw, tiles, seed) -> None:
    """Capped fp32 logits, or the values before the cap (bf16 as the model's lm_head gives
    them, or fp32) capped by the op at 30; every work split."""
    logits, noise, temp = make_case(lead, vocab, seed, raw=raw)
    groups = lead[:-1]
    keep_mask = {"none": None, "all": torch.ones(groups, dtype=torch.bool),
                 "some": torch.arange(len(groups) and groups[0] or 1).reshape(groups) % 2 == 1
                 }[keep]
    if keep_mask is not None:
        keep_mask = keep_mask.to(DEVICE)
    assert_proposal(*run_both(logits, noise, temp, sc_dtype, keep_mask, seed,
                              30.0 if raw else 0.0, tiles), exact_sc=raw is None)


def test_soft_cap_values() -> None:
    """The cap inside the op: `tanh(x / 30) * 30` for values from tiny to far past the cap
    (where it saturates at 30, never above), within an ulp of PyTorch's; at temperature 1
    the self-conditioning input is the capped value."""
    x = torch.tensor([[0.0, 1e-6, -1e-6, 0.5, -3.0, 29.0, 60.0, -300.0, 1e4, -1e30]])
    sc = torch.empty_like(x, device=DEVICE)
    noise = torch.ones_like(x, device=DEVICE)
    _, argmax, _ = canvas_propose(x.to(DEVICE), noise, torch.tensor(1.0, device=DEVICE), sc,
                                  softcap=30.0)
    want = torch.tanh(x / 30.0) * 30.0
    torch.testing.assert_close(sc.cpu(), want, rtol=2.0**-22, atol=1e-12)
    assert sc.abs().max().item() <= 30.0 and sc[0, 0].item() == 0.0
    assert int(argmax[0]) == 8


def test_kept_rows_and_written_rows() -> None:
    """Group 0 stopped: its rows of `sc_out` are untouched; group 1's are `logits / temp`."""
    logits, noise, temp = make_case((2, 3), 500, 1)
    keep = torch.tensor([True, False], device=DEVICE)
    _, _, sc, _ = run_both(logits, noise, temp, torch.float32, keep, 1)
    before = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(sc[0], before[0])
    assert torch.equal(sc[1], logits[1] / temp)


@pytest.mark.parametrize("tiles", TILES)
def test_ties_go_to_the_lowest_index_across_chunks(tiles: ProposeTiles) -> None:
    """Equal logits everywhere: the argmax is 0; equal maxima of the sample's key in two chunks
    (noise 1 except two equal small draws): the first of them; equal maxima in one tile and
    in two tiles of one chunk: the first of them."""
    vocab = 2 * CHUNK + 5
    logits = torch.zeros(1, vocab, device=DEVICE)
    noise = torch.ones(1, vocab, device=DEVICE)
    noise[0, CHUNK + 3] = noise[0, 2 * CHUNK + 1] = 0.25
    sc = torch.empty(1, vocab, device=DEVICE)
    temp = torch.tensor(0.5, device=DEVICE)
    sample, argmax, entropy = canvas_propose(logits, noise, temp, sc, tiles=tiles)
    assert int(argmax[0]) == 0 and int(sample[0]) == CHUNK + 3
    assert entropy[0].item() == pytest.approx(torch.log(torch.tensor(float(vocab))).item(),
                                              rel=1e-6)
    logits[0, [tiles.block + 7, tiles.block + 3, 2 * tiles.block + 1]] = 2.0
    noise[0, [tiles.block + 9, tiles.block + 5, 5]] = 1e-6  # entries 9, 5 and 5 of two tiles
    sample, argmax, _ = canvas_propose(logits, noise, temp, sc, tiles=tiles)
    assert int(argmax[0]) == tiles.block + 3 and int(sample[0]) == 5


def test_tiles_are_validated() -> None:
    with pytest.raises(ValueError, match="ProposeTiles.block=1000: expected a power of two"):
        ProposeTiles(block=1000)
    with pytest.raises(ValueError, match="block 4096 exceeds chunk 2048"):
        ProposeTiles(chunk=2048, block=4096)


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
    with pytest.raises(ValueError, match=r"logits must be contiguous fp32 or bf16 \[\.\.\., C"):
        canvas_propose(logits.double(), noise, temp, sc)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        canvas_propose(logits, noise, temp, sc, softcap=-1.0)
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
    for softcap in (0.0, 30.0):
        torch.library.opcheck(torch.ops.dlmc.canvas_propose.default,
                              (logits, noise, temp, sc, torch.tensor([True, False], device=DEVICE),
                               softcap, 64, 16, 2),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [None, torch.bfloat16])
def test_full_canvas_compiled_and_replayed(raw: torch.dtype | None) -> None:
    """DiffusionGemma's shape (256 x 262144, bf16 self-conditioning), from capped fp32 logits
    or from the lm_head's bf16 output capped inside: eager, then compiled and captured (the op
    traced by Inductor, `sc_out` mutated inside the graph), equal to the reference on new
    inputs at every replay."""
    softcap = 30.0 if raw else 0.0
    logits, noise, temp = make_case((256,), 262144, 5, raw=raw)
    assert_proposal(*run_both(logits, noise, temp, torch.bfloat16, None, 5, softcap),
                    exact_sc=raw is None)
    sc = torch.zeros(logits.shape, dtype=torch.bfloat16, device=DEVICE)
    keep = torch.zeros((), dtype=torch.bool, device=DEVICE)
    graph, out = compile_and_capture(
        lambda lg, nz, tp, kp: canvas_propose(lg, nz, tp, sc, kp, softcap),
        logits, noise, temp, keep)
    for seed in (6, 7):
        case = make_case((256,), 262144, seed, raw=raw)
        for buffer, value in zip((logits, noise, temp), case, strict=True):
            buffer.copy_(value)
        want_sc = sc.clone()
        want = canvas_propose_reference(logits, noise, temp, want_sc, keep, softcap)
        graph.replay()
        assert_proposal(out, want, sc, want_sc, exact_sc=raw is None)
    keep.fill_(True)
    kept = sc.clone()
    graph.replay()
    assert torch.equal(sc, kept)
