"""Commit/edit rules of the block decoders as pure tensor functions (no host syncs).

Shapes: one block of `bl` positions. `active` marks positions that still hold the mask and
may be decoded; `editable` marks decoded (non-prompt) positions that T2T may rewrite.
"""

from __future__ import annotations

import torch

# Columns per chunk of the chunked row reductions: 614 = LLaDA2's vocabulary (157,184) / 256,
# the fastest width measured for the one-pass greedy reductions on an H200 (wider chunks leave
# Inductor's persistent reduction for a looped one).
ARGMAX_CHUNK_WIDTH = 614


def _chunks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """`x [bl, V]` as `[bl, C, ARGMAX_CHUNK_WIDTH]` with `C = ceil(V / ARGMAX_CHUNK_WIDTH)`,
    padded with `fill`."""
    rows, width = x.shape
    count = max(1, -(-width // ARGMAX_CHUNK_WIDTH))
    padded = torch.nn.functional.pad(x, (0, count * ARGMAX_CHUNK_WIDTH - width), value=fill)
    return padded.view(rows, count, ARGMAX_CHUNK_WIDTH)


def _chunk_argmax(chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunks [bl, C, W]` -> each chunk's max `[bl, C]`, and each row's max and first argmax
    (a column of the unchunked row) `[bl]`."""
    part_max, part_idx = chunks.max(dim=-1)  # [bl, C]
    top, which = part_max.max(dim=-1)  # [bl]
    index = which * chunks.shape[-1] + part_idx.gather(1, which[:, None])[:, 0]
    return part_max, top, index


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(max, argmax)` of each row of `logits [bl, V]`, the first index among equal maxima.

    In two stages over column chunks of `ARGMAX_CHUNK_WIDTH`: a compiled argmax over a few
    very long rows runs one program per row, a chunked one fills the GPU (~7x faster at
    32 x 157k).
    """
    _, top, index = _chunk_argmax(_chunks(logits, float("-inf")))
    return top, index


def row_argmax_sumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(max, argmax, sum(exp(logits - max)))` of each row of `logits [bl, V]` in one pass.

    Each column chunk takes its max, first argmax and sum of `exp(x - chunk max)` together
    (one reduction kernel when compiled, where `row_argmax` then `chunked_row_sum` read the
    row twice); the chunk sums are rescaled to the row's max, `sum_c s_c * exp(m_c - max)`,
    as an online softmax does. A chunk of -inf only (padding, masked columns) adds 0. The
    argmax is `row_argmax`'s, the sum equals the two-pass one up to the order of the fp32 sums.
    """
    chunks = _chunks(logits, float("-inf"))
    part_max, top, index = _chunk_argmax(chunks)
    finite = torch.where(part_max == float("-inf"), 0.0, part_max)  # no -inf - -inf
    part_sum = torch.exp(chunks - finite[..., None]).sum(dim=-1)  # [bl, C]
    total = (part_sum * torch.exp(finite - top[:, None])).sum(dim=-1)  # [bl]
    return top, index, total


def chunked_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums of `x [bl, V]` through partial sums over column chunks (parallel when compiled)."""
    return _chunks(x, 0.0).sum(dim=-1).sum(dim=-1)  # [bl]


def top_k_top_p_filter(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """`logits [bl, V]` with the tokens that top-k, then top-p, drop set to -inf.

    Top-k keeps every token whose logit is at least the k-th largest (ties with it included).
    Top-p then keeps, per row, the smallest prefix of the tokens sorted by probability (under
    the top-k filtered distribution) whose mass reaches `top_p` (>= top_p): a token is kept
    when the mass before it is below `top_p`, so the most probable token always is (as
    Hugging Face's `TopPLogitsWarper`).
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [bl, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [bl, V]
        sorted_probs = sorted_logits.softmax(-1)  # [bl, V]
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # mass before >= p
        drop_sorted[:, 0] = False  # the most probable stays, whatever p rounds to in fp32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def propose(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposal per position from fp32 `logits [bl, V]`: `(x0 [bl] int64, p [bl] fp32)`.

    Temperature 0: x0 = argmax and p its probability (under the top-k/top-p filtered
    distribution when those are set). Otherwise logits / temperature, top-k then top-p, sample
    x0; p is x0's probability under that filtered distribution.
    """
    logits = logits.float()
    if temperature <= 0.0 and top_k is None and (top_p is None or top_p >= 1.0):
        # Greedy: p(argmax) = exp(0) / sum(exp(logits - max)) = 1 / that sum. Row reductions
        # instead of a materialised [bl, V] softmax (the vocabulary is ~157k wide).
        _, x0, total = row_argmax_sumexp(logits)  # [bl]
        return x0, 1.0 / total
    if temperature > 0.0:
        logits = logits / temperature
    probs = top_k_top_p_filter(logits, top_k, top_p).softmax(-1)  # [bl, V]
    if temperature > 0.0:
        x0 = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [bl]
        return x0, probs.gather(-1, x0[:, None]).squeeze(-1)
    p, x0 = probs.max(dim=-1)
    return x0, p


def propose_with_noise(
    logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`propose` at a temperature > 0 without top-k/top-p, from noise drawn before the round.

    `temperature`: fp32 `[]` tensor (one compiled round serves every temperature); `noise`:
    fp32 `[bl, V]`, Exp(1) draws (`Tensor.exponential_`). `x0 = argmax(probs / noise)`, which
    is how `torch.multinomial` draws one sample: with `noise` drawn from the generator that
    `propose` would pass it, both take the same x0 and leave the generator in the same state.
    `p` is x0's probability. Row reductions in chunks, as the greedy path (parallel when
    compiled); the only random draw stays outside, so the rest captures into a CUDA graph.
    """
    scaled = logits.float() / temperature  # [bl, V]
    top, _ = row_argmax(scaled)  # [bl]
    weights = torch.exp(scaled - top[:, None])  # [bl, V]
    probs = weights / chunked_row_sum(weights)[:, None]
    _, x0 = row_argmax(probs / noise)  # [bl]
    return x0, probs.gather(-1, x0[:, None]).squeeze(-1)


def _top_active(
    conf: torch.Tensor, active: torch.Tensor, count: int | torch.Tensor
) -> torch.Tensor:
    """Mask of the `count` active positions with the highest confidence `conf [bl]`.

    Rank-based (ties go to the lower position), so `count` may be a device tensor: no sync.
    """
    order = conf.argsort(descending=True, stable=True)  # [bl]
    ranks = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                    device=order.device))
    return (ranks < count) & active


def joint_threshold_step(
    block: torch.Tensor,
    x0: torch.Tensor,
    p: torch.Tensor,
    active: torch.Tensor,
    editable: torch.Tensor,
    threshold: float | torch.Tensor,
    edit_threshold: float | torch.Tensor | None,
    num_to_transfer: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaDA2.1 round (docs/llada2.md §5.4): `(new_block, committed [bl], edited [bl])`.

    M2T: commit every active position with p > threshold, or if fewer than `num_to_transfer`
    pass, the `num_to_transfer` most confident active positions. T2T (every round, also while
    masks remain): rewrite non-active editable positions whose p > edit_threshold and whose
    proposal differs. Thresholds may be 0-d device tensors (graph-captured rounds).
    """
    conf = torch.where(active, p, torch.full_like(p, float("-inf")))  # [bl]
    high = active & (p > threshold)
    fallback = _top_active(conf, active, num_to_transfer)
    committed = torch.where(high.sum() >= num_to_transfer, high, fallback)
    if edit_threshold is None:
        edited = torch.zeros_like(active)
    else:
        edited = ~active & editable & (p > edit_threshold) & (x0 != block)
    new_block = torch.where(committed | edited, x0, block)
    return new_block, committed, edited


def threshold_step(
    block: torch.Tensor,
    x0: torch.Tensor,
    p: torch.Tensor,
    active: torch.Tensor,
    threshold: float | torch.Tensor,
    quota: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2.0 round (docs/llada2.md §5.3): `(new_block, committed [bl])`.

    Commit every active position with p > threshold if at least `quota` pass, else the
    `quota` most confident active positions.
    """
    conf = torch.where(active, p, torch.full_like(p, float("-inf")))
    high = active & (conf > threshold)
    committed = torch.where(high.sum() >= quota, high, _top_active(conf, active, quota))
    return torch.where(committed, x0, block), committed


def step_quotas(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` steps: bl // steps, +1 for the first bl % steps."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]
