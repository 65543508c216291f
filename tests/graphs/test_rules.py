import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.graphs import rules
from dlmc.graphs.round import RoundBuffers, decide
from dlmc.graphs.rules import (
    joint_threshold_step,
    propose,
    propose_with_noise,
    row_argmax,
    row_argmax_sumexp,
    step_quotas,
    threshold_step,
    top_k_top_p_filter,
)


def test_propose_greedy_and_filtered():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    x0, p = propose(logits)
    assert x0.tolist() == [1, 0]
    torch.testing.assert_close(p, logits.softmax(-1).max(-1).values)
    x0k, pk = propose(logits, top_k=2)
    assert x0k.tolist() == [1, 0]
    torch.testing.assert_close(pk[0], torch.tensor([2.0, 1.0]).softmax(-1)[0])


def test_propose_sampling_is_seeded_and_p_is_under_the_filtered_distribution():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    a = propose(logits, 0.7, 5, 0.9, torch.Generator().manual_seed(3))
    b = propose(logits, 0.7, 5, 0.9, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0])
    top5 = (logits / 0.7).topk(5, -1).indices
    assert all(int(x) in top5[i].tolist() for i, x in enumerate(a[0]))
    assert bool((a[1] > 0).all())


def test_propose_with_noise_is_propose_with_the_same_generator():
    """Noise drawn with a generator, then `propose_with_noise`: the x0 that `propose` samples
    with a generator of the same seed (torch.multinomial's one-sample draw), the same p up to
    the softmax's rounding, and the generators left in the same state."""
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(1)) * 4
    for temperature in (0.3, 0.7, 1.5):
        sampled, drawn = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        x0, p = propose(logits, temperature, None, None, sampled)
        noise = torch.empty_like(logits).exponential_(1, generator=drawn)
        y0, q = propose_with_noise(logits, torch.tensor(temperature), noise)
        assert torch.equal(x0, y0)
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
        assert torch.equal(sampled.get_state(), drawn.get_state())
    assert len(set(x0.tolist())) > 1


def test_joint_commit_falls_back_to_most_confident_and_never_touches_prompt():
    block = torch.tensor([5, 9, 9, 9, 3])  # pos 0 prompt, pos 4 decoded earlier
    active = torch.tensor([False, True, True, True, False])
    editable = torch.tensor([False, True, True, True, True])
    x0 = torch.tensor([1, 2, 2, 2, 4])
    p = torch.tensor([0.99, 0.3, 0.6, 0.4, 0.7])
    new, committed, edited = joint_threshold_step(block, x0, p, active, editable, 0.85, 0.5)
    assert committed.tolist() == [False, False, True, False, False]  # fallback: top-1
    assert edited.tolist() == [False, False, False, False, True]  # T2T while masks remain
    assert new.tolist() == [5, 9, 2, 9, 4]  # prompt position 0 untouched despite p = 0.99


def test_joint_threshold_commits_all_above_and_edit_is_strict():
    block = torch.tensor([9, 9, 7])
    active = torch.tensor([True, True, False])
    editable = torch.ones(3, dtype=torch.bool)
    x0 = torch.tensor([1, 2, 3])
    p = torch.tensor([0.9, 0.86, 0.5])
    new, committed, edited = joint_threshold_step(block, x0, p, active, editable, 0.85, 0.5)
    assert committed.tolist() == [True, True, False] and not edited.any()  # 0.5 is not > 0.5
    new, _, edited = joint_threshold_step(block, x0, p, active, editable, 0.85, None)
    assert not edited.any()


def test_threshold_step_quota():
    block = torch.tensor([9, 9, 9, 9])
    active = torch.ones(4, dtype=torch.bool)
    x0 = torch.tensor([1, 2, 3, 4])
    p = torch.tensor([0.96, 0.5, 0.7, 0.2])
    new, committed = threshold_step(block, x0, p, active, 0.95, quota=2)
    assert committed.tolist() == [True, False, True, False]
    new, committed = threshold_step(block, x0, p, active, 0.4, quota=2)
    assert committed.tolist() == [True, True, True, False]
    assert new.tolist() == [1, 2, 3, 9]
    assert step_quotas(32, 32) == [1] * 32 and step_quotas(10, 4) == [3, 3, 2, 2]


def test_greedy_propose_matches_the_softmax_of_the_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 5000, generator=gen) * 4.0
    logits[:, 7] = float("-inf")  # a masked column (the mask token)
    x0, p = propose(logits)
    probs = logits.softmax(-1)
    assert torch.equal(x0, logits.argmax(-1))
    # Two fp32 sums of 5,000 terms in different orders (softmax's vectorised one depends on
    # the CPU's instruction set): 1.6e-6 apart on one machine, so 1e-5, not 1e-6.
    torch.testing.assert_close(p, probs.gather(-1, x0[:, None])[:, 0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("chunk", [16, 1024])
@pytest.mark.parametrize("width", [1, 255, 256, 257, 5000])
def test_row_argmax_matches_torch_and_takes_the_first_of_equal_maxima(width, chunk, monkeypatch):
    monkeypatch.setattr(rules, "ARGMAX_CHUNK_WIDTH", chunk)
    gen = torch.Generator().manual_seed(width)
    logits = torch.randint(-3, 4, (5, width), generator=gen).float()  # many ties
    logits[0] = float("-inf")
    logits[0, width // 2] = 1.0
    top, index = row_argmax(logits)
    assert torch.equal(top, logits.max(-1).values)
    first = (logits == logits.max(-1, keepdim=True).values).float().argmax(-1)
    assert torch.equal(index, first)


@pytest.mark.parametrize("chunk", [16, 1024])
@pytest.mark.parametrize("width", [1, 255, 256, 257, 5000])
def test_row_argmax_sumexp_is_the_two_pass_max_argmax_and_sum(width, chunk, monkeypatch):
    monkeypatch.setattr(rules, "ARGMAX_CHUNK_WIDTH", chunk)
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=gen) * 4
    logits[1] = torch.randint(-3, 4, (width,), generator=gen).float()  # ties
    logits[0] = float("-inf")  # every chunk but one holds -inf only
    logits[0, width // 2] = 1.0
    logits[2, : width // 2] = float("-inf")
    top, index, total = row_argmax_sumexp(logits)
    want_top, want_index = row_argmax(logits)
    assert torch.equal(top, want_top)
    assert torch.equal(index, want_index)
    want = torch.exp(logits.double() - want_top.double()[:, None]).sum(-1)
    assert torch.isfinite(total).all()
    assert total[0] == 1.0
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=0)


def _on_the_threshold_logits() -> torch.Tensor:
    """Logits `[4, 8]` whose greedy proposals have p exactly 0.5 (two equal maxima: the first
    proposed), 0.5 again, 1/3 (three equal maxima) and 1.0 (one finite logit)."""
    logits = torch.full((4, 8), float("-inf"))
    logits[0, [2, 5]] = 1.0
    logits[1, [3, 4]] = -2.0
    logits[2, [1, 2, 3]] = 0.0
    logits[3, 6] = 0.0
    return logits


@pytest.mark.parametrize("algorithm", ["threshold", "joint"])
def test_a_probability_exactly_on_the_commit_threshold_is_not_committed(algorithm):
    """docs/llada2.md §5.3, §5.4: commit where p > threshold, strictly. Rows 0 and 1 propose
    with p = 0.5 exactly, on a threshold of 0.5: only row 3 (p = 1) passes, which meets the
    quota / num_to_transfer of 1, so rows 0-2 stay masked."""
    mask = 7
    logits = _on_the_threshold_logits()
    x0, p = propose(logits.clone())
    assert p.tolist() == [0.5, 0.5, pytest.approx(1 / 3), 1.0] and x0.tolist() == [2, 3, 1, 6]
    buf = RoundBuffers.allocate(4, 4, torch.device("cpu"))
    buf.tokens.fill_(mask)
    buf.editable.fill_(True)
    buf.threshold.fill_(0.5)
    buf.edit_threshold.fill_(0.5)
    buf.quotas[:4] = 1
    buf.steps.fill_(4)
    buf.max_post.fill_(4)
    decide(logits, buf, mask, algorithm)
    assert buf.committed.tolist() == [False, False, False, True]
    assert buf.tokens.tolist() == [mask, mask, mask, 6]


def test_probabilities_on_the_threshold_leave_the_commit_to_the_fallback():
    """Two masks at p = 0.5 on a threshold of 0.5: none passes, so both rules commit the
    quota / num_to_transfer most confident (ties: the lower position), not both."""
    mask = 7
    new, committed = threshold_step(torch.full((2,), mask), torch.tensor([4, 5]),
                                    torch.tensor([0.5, 0.5]), torch.ones(2, dtype=torch.bool),
                                    torch.tensor(0.5), quota=1)
    assert committed.tolist() == [True, False] and new.tolist() == [4, mask]
    new, committed, _ = joint_threshold_step(
        torch.full((2,), mask), torch.tensor([4, 5]), torch.tensor([0.5, 0.5]),
        torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool), torch.tensor(0.5),
        None)
    assert committed.tolist() == [True, False] and new.tolist() == [4, mask]


def test_a_probability_exactly_on_the_edit_threshold_is_not_an_edit():
    """docs/llada2.md §5.4, §5.5: T2T rewrites a decoded token where p > edit threshold,
    strictly. Rows 0 and 1 hold decoded tokens whose proposals differ with p = 0.5 exactly
    (edit threshold 0.5): kept; row 3's proposal differs with p = 1: edited."""
    mask = 7
    buf = RoundBuffers.allocate(4, 4, torch.device("cpu"))
    buf.tokens.copy_(torch.tensor([0, 0, mask, 0]))
    buf.editable.fill_(True)
    buf.threshold.fill_(0.9)
    buf.edit_threshold.fill_(0.5)
    buf.max_post.fill_(4)
    decide(_on_the_threshold_logits(), buf, mask, "joint")
    assert buf.edited.tolist() == [False, False, False, True]
    assert buf.committed.tolist() == [False, False, True, False]  # the fallback, row 2
    assert buf.tokens.tolist() == [0, 0, 1, 6]


@st.composite
def _filter_cases(draw):
    """Rows of logits with ties (small integers) or spread values (floats), some -inf, at
    least one finite per row; a top-k (or None) and a top-p in (0, 1] (some below fp32's
    smallest number)."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    tied = draw(st.booleans())
    value = (st.integers(-3, 3).map(float) if tied
             else st.floats(-8.0, 8.0, allow_nan=False, width=32))
    logits = torch.tensor(draw(st.lists(st.lists(value, min_size=width, max_size=width),
                                        min_size=rows, max_size=rows)), dtype=torch.float32)
    dropped = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=width,
                                                  max_size=width), min_size=rows,
                                         max_size=rows)))
    dropped[:, 0] = False
    logits = logits.masked_fill(dropped, float("-inf"))
    top_k = draw(st.one_of(st.none(), st.integers(1, width + 2)))
    # and values that round to 0 in fp32: the most probable token still stays
    top_p = draw(st.one_of(st.none(), st.floats(0.01, 1.0),
                           st.sampled_from([5e-324, 1e-300, 1e-46])))
    return logits, top_k, top_p


@settings(max_examples=200, deadline=None)
@given(_filter_cases(), st.integers(0, 2**31 - 1))
def test_top_k_top_p_keep_the_smallest_probable_prefix(case, seed):
    """Top-k keeps the tokens at least as likely as the k-th; top-p then keeps the fewest most
    probable tokens whose mass (under the top-k distribution) reaches top_p: never empty,
    always an argmax, kept logits unchanged. Checked against float64 sums; a row whose mass
    before a token lies within 1e-5 of top_p (fp32 rounding decides) is checked for the
    invariants only. `propose` samples from that set, with p under it."""
    logits, top_k, top_p = case
    filtered = top_k_top_p_filter(logits, top_k, top_p)
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])
    for row in range(logits.shape[0]):
        x, keep = logits[row].double(), kept[row]
        finite = torch.isfinite(x)
        assert keep.any() and x[keep].max() == x.max()  # an argmax is kept
        by_k = finite.clone()
        if top_k is not None and top_k < x.numel():
            kth = x.sort(descending=True).values[top_k - 1]
            by_k &= x >= kth
        if top_p is None or top_p >= 1.0:
            assert torch.equal(keep, by_k)
            continue
        assert not (keep & ~by_k).any()
        probs = torch.where(by_k, x, float("-inf")).softmax(-1)
        rest = probs[by_k & ~keep]
        assert rest.numel() == 0 or probs[keep].min() >= rest.max()  # a top set
        ordered = probs[by_k].sort(descending=True).values
        before = ordered.cumsum(0) - ordered  # mass before each token
        if (before - top_p).abs().min() < 1e-5:
            continue
        assert int(keep.sum()) == int((before < top_p).sum())
    generator = torch.Generator().manual_seed(seed)
    x0, p = propose(logits, 1.0, top_k, top_p, generator)
    assert kept.gather(-1, x0[:, None]).all()
    want = filtered.softmax(-1).gather(-1, x0[:, None])[:, 0]
    torch.testing.assert_close(p, want)


@pytest.mark.parametrize(("top_p", "kept"), [(0.25, 1), (0.5, 2), (0.5001, 3), (0.75, 3),
                                             (0.7499, 3), (1.0, 4)])
def test_top_p_keeps_the_token_whose_mass_reaches_top_p_exactly(top_p, kept):
    """Four equal logits: p = 0.25 each, sums exact in fp32. Mass 0.5 reaches top_p 0.5 with
    two tokens (a third is not kept); 0.5001 needs a third."""
    logits = torch.zeros(1, 4)
    assert int(torch.isfinite(top_k_top_p_filter(logits, None, top_p)).sum()) == kept


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(top_k_top_p_filter(logits, 2)).tolist() == [
        [True, False, True, True, False]]
    assert torch.isfinite(top_k_top_p_filter(logits, 1)).tolist() == [
        [True, False, False, False, False]]
    # top-p over the top-k distribution: 3 and two 2s renormalised, top_p 0.5 keeps the 3 only
    # (e^3 / (e^3 + 2 e^2) = 0.576).
    assert torch.isfinite(top_k_top_p_filter(logits, 2, 0.5)).tolist() == [
        [True, False, False, False, False]]
