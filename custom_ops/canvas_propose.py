"""`dlmc::canvas_propose`: a DiffusionGemma denoising step's proposal in two Triton launches.

The proposal (`graphs.canvas_rules.propose`) reads the step's soft-capped logits `[R, V]`
and its Exp(1) noise `[R, V]` (R rows = canvas positions, V = 262144 for the real model) and
returns, per row, the categorical sample `argmax(softmax(t) / noise)`, `argmax(t)` and the
entropy of `softmax(t)`, with `t = logits / T`; the next step's self-conditioning input is `t`
in the model dtype. With `softcap` > 0 the op takes the lm_head's output before the cap (the
model dtype) and caps it itself, `logits = tanh(x / softcap) * softcap` in fp32, so that the
capped fp32 logits are never written to memory. Compiled by Inductor as torch ops, the
proposal is one reduction kernel per row over 1 MB of logits and 1 MB of noise: 256
programs, too few to stream 0.5 GB at the copy speed. Here the first launch splits each row
into chunks of `CHUNK` entries (R x V / CHUNK programs), reads logits and noise once, writes
`t` (in the dtype of `sc_out`) and keeps, per chunk, online log-sum-exp statistics and both
argmaxes; the second launch merges each row's chunks.

Maths (exact in real arithmetic, the same as the torch form up to fp32 rounding):
- per chunk, with `m` its largest `t`: `s = sum exp(t - m)`, `w = sum exp(t - m) * (t - m)`;
  chunks merge to the row's `(M, S, W)`; the entropy is `log S - W / S` (= `-sum p log p`).
- the sample is `argmax(t - log(noise))`, the logarithm of `softmax(t) / noise` up to the
  row's constant `M + log S`: no second pass over the row.
- ties go to the lowest index (`torch.argmax`'s rule): inside a tile by `tl.argmax`, across
  tiles and chunks by a strict comparison in index order.
- `t` is `logits / T` with IEEE division (`div_rn`), so from capped logits the
  self-conditioning input and the argmax are eager PyTorch's to the bit; the sample and the
  entropy may differ from it in the last bits (another summation order), as Inductor's
  kernels already do. The cap's tanh is CUDA's `tanhf` (libdevice); the interpreter, which has
  no libdevice, takes it from `exp` in fp64: both within an ulp or two of PyTorch's, so a
  capped value, and through it `t`, may differ from eager PyTorch's in its last bit.
`sc_keep` (bool, one per row group): rows whose group is set keep `sc_out` as it is (a canvas
stopped before the step keeps its previous self-conditioning input). The maths is
`canvas_propose_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED as _INTERPRETED
from dlmc.custom_ops._registration import traced_triton_op
from dlmc.custom_ops.nvfp4_tiles import round_bf16

__all__ = ["CHUNK", "DEFAULT_TILES", "ProposeTiles", "canvas_propose",
           "canvas_propose_reference"]


@dataclass(frozen=True)
class ProposeTiles:
    """The first launch's work split (the results do not depend on it, up to the order of the
    entropy's fp32 sums): `chunk` vocabulary entries per program, `block` entries per iteration
    of its loop (powers of two, block <= chunk), `num_warps` per program."""

    chunk: int = 8192
    block: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("chunk", "block", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"ProposeTiles.{name}={value!r}: expected a power of two")
        if self.block > self.chunk:
            raise ValueError(f"ProposeTiles: block {self.block} exceeds chunk {self.chunk}")


DEFAULT_TILES = ProposeTiles()
CHUNK = DEFAULT_TILES.chunk  # vocabulary entries per program of the first launch
_SC_DTYPES = (torch.bfloat16, torch.float32)
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32


def canvas_propose_reference(
    logits: torch.Tensor, exponential: torch.Tensor, temp: torch.Tensor, sc_out: torch.Tensor,
    sc_keep: torch.Tensor | None, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch maths: `(sample [...], argmax [...], entropy [...])` for `logits [..., V]`
    (soft-capped first when `softcap` > 0); writes `(logits / temp)` in `sc_out`'s dtype to
    `sc_out` except in the rows whose entry of `sc_keep` (shape `logits.shape[:-2]`, or None)
    is set."""
    logits = logits.float()
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    tempered = logits / temp  # [..., V] fp32
    probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
    sample = torch.argmax(probs / exponential, dim=-1)
    argmax = torch.argmax(tempered, dim=-1)
    log_p = tempered - tempered.logsumexp(dim=-1, keepdim=True)
    entropy = -(torch.clamp(log_p, min=torch.finfo(log_p.dtype).min) * probs).sum(-1)
    new = tempered.to(sc_out.dtype)
    if sc_keep is not None:
        new = torch.where(sc_keep[..., None, None], sc_out, new)
    sc_out.copy_(new)
    return sample, argmax, entropy


@triton.jit
def _merge(m, s, w, m2, s2, w2):
    """Log-sum-exp statistics `(max, sum exp(t - max), sum exp(t - max) (t - max))` of two
    parts -> those of their union (every max finite)."""
    mn = tl.maximum(m, m2)
    a = tl.exp(m - mn)
    b = tl.exp(m2 - mn)
    return mn, s * a + s2 * b, a * (w + s * (m - mn)) + b * (w2 + s2 * (m2 - mn))


@triton.jit
def _soft_cap(x, softcap, INTERPRETED: tl.constexpr):
    """`tanh(x / softcap) * softcap` in fp32: CUDA's `tanhf`; under the interpreter (no
    libdevice) tanh from `exp` in fp64, then rounded to fp32. `softcap`: a scalar of any float
    type (Inductor passes a Python float as fp64, its analysis of the kernel's writes as a
    constant; the interpreter as a Python float)."""
    if not INTERPRETED:
        softcap = tl.cast(softcap, tl.float32)
    z = tl.math.div_rn(x, softcap)
    if INTERPRETED:
        e = tl.exp(-2.0 * tl.abs(z.to(tl.float64)))
        th = (1.0 - e) / (1.0 + e)  # tanh(|z|), no cancellation near 0 in fp64
        th = tl.where(z < 0, -th, th).to(tl.float32)
    else:
        th = libdevice.tanh(z)
    return th * softcap


@triton.jit
def propose_chunk_kernel(logits_ptr, noise_ptr, temp_ptr, sc_ptr, keep_ptr, stats_ptr, idx_ptr,
                         vocab, canvas, num_chunks, stride_l, stride_n, stride_sc, softcap,
                         HAS_KEEP: tl.constexpr, SOFTCAP: tl.constexpr, SC_BF16: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Chunk `c` of row `r`: writes `t` to `sc` (unless kept) and the chunk's statistics
    `(m, s, w, max t, max t - log noise)` and the two argmaxes."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr)
    if HAS_KEEP:
        write = tl.load(keep_ptr + row // canvas).to(tl.int32) == 0
    else:
        write = tl.full((), 1, tl.int1)
    m = tl.full((), -FLT_MAX, tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    best_t = tl.full((), -float("inf"), tl.float32)
    best_t_idx = tl.zeros((), tl.int32)
    best_g = tl.full((), -float("inf"), tl.float32)
    best_g_idx = tl.zeros((), tl.int32)
    for step in tl.static_range(0, CHUNK, BLOCK):  # tiles past the vocabulary: all masked
        off = chunk * CHUNK + step
        cols = off + tl.arange(0, BLOCK)
        live = cols < vocab
        x = tl.load(logits_ptr + row * stride_l + cols, mask=live, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = _soft_cap(x, softcap, INTERPRETED)
        t = tl.math.div_rn(x, temp)
        if SC_BF16:
            tl.store(sc_ptr + row * stride_sc + cols, round_bf16(t, INTERPRETED),
                     mask=live & write)
        else:
            tl.store(sc_ptr + row * stride_sc + cols, t, mask=live & write)
        noise = tl.load(noise_ptr + row * stride_n + cols, mask=live, other=1.0)
        t_live = tl.where(live, t, -FLT_MAX)  # (a finite floor: an all-masked tile merges as 0)
        g = tl.where(live, t - tl.log(noise), -float("inf"))
        tile_max, tile_idx = tl.max(t_live, axis=0, return_indices=True)
        centred = t_live - tile_max
        e = tl.where(live, tl.exp(centred), 0.0)
        tile_w = tl.sum(e * tl.where(live, centred, 0.0), axis=0)
        m, s, w = _merge(m, s, w, tile_max, tl.sum(e, axis=0), tile_w)
        better = tile_max > best_t
        best_t_idx = tl.where(better, off + tile_idx, best_t_idx)
        best_t = tl.where(better, tile_max, best_t)
        tile_g, tile_g_idx = tl.max(g, axis=0, return_indices=True)
        better = tile_g > best_g
        best_g_idx = tl.where(better, off + tile_g_idx, best_g_idx)
        best_g = tl.where(better, tile_g, best_g)
    out = (row * num_chunks + chunk) * 5
    tl.store(stats_ptr + out, m)
    tl.store(stats_ptr + out + 1, s)
    tl.store(stats_ptr + out + 2, w)
    tl.store(stats_ptr + out + 3, best_t)
    tl.store(stats_ptr + out + 4, best_g)
    tl.store(idx_ptr + (row * num_chunks + chunk) * 2, best_t_idx)
    tl.store(idx_ptr + (row * num_chunks + chunk) * 2 + 1, best_g_idx)


@triton.jit
def propose_merge_kernel(stats_ptr, idx_ptr, sample_ptr, argmax_ptr, entropy_ptr, num_chunks,
                         CHUNKS_PAD: tl.constexpr):
    """Row `r`: its chunks' statistics -> the sample, the argmax and the entropy."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    live = c < num_chunks
    base = (row * num_chunks + c) * 5
    m = tl.load(stats_ptr + base, mask=live, other=-FLT_MAX)
    s = tl.load(stats_ptr + base + 1, mask=live, other=0.0)
    w = tl.load(stats_ptr + base + 2, mask=live, other=0.0)
    big_m = tl.max(m, axis=0)
    a = tl.exp(m - big_m)
    total = tl.sum(s * a, axis=0)
    weighted = tl.sum(a * (w + s * (m - big_m)), axis=0)
    tl.store(entropy_ptr + row, tl.log(total) - weighted / total)
    for which in tl.static_range(2):  # 0: argmax of t, 1: the sample
        v = tl.load(stats_ptr + base + 3 + which, mask=live, other=-float("inf"))
        i = tl.load(idx_ptr + (row * num_chunks + c) * 2 + which, mask=live, other=0)
        first = tl.min(tl.where(live & (v == tl.max(v, axis=0)), i, 2147483647), axis=0)
        if which == 0:
            tl.store(argmax_ptr + row, first.to(tl.int64))
        else:
            tl.store(sample_ptr + row, first.to(tl.int64))


def _canvas_propose_impl(
    logits: torch.Tensor, exponential: torch.Tensor, temp: torch.Tensor, sc_out: torch.Tensor,
    sc_keep: torch.Tensor | None, softcap: float, chunk: int, block: int, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vocab = logits.shape[-1]
    rows = logits.numel() // vocab
    canvas = logits.shape[-2] if logits.dim() >= 2 else 1
    lead = logits.shape[:-1]
    sample = logits.new_empty(lead, dtype=torch.int64)
    argmax = logits.new_empty(lead, dtype=torch.int64)
    entropy = logits.new_empty(lead, dtype=torch.float32)
    if rows == 0:
        return sample, argmax, entropy
    chunk = min(chunk, triton.next_power_of_2(vocab))  # (a small vocabulary: one chunk)
    num_chunks = triton.cdiv(vocab, chunk)
    stats = logits.new_empty((rows, num_chunks, 5), dtype=torch.float32)
    idx = logits.new_empty((rows, num_chunks, 2), dtype=torch.int32)
    block = min(block, chunk)
    launcher(propose_chunk_kernel)[(rows, num_chunks)](
        logits, exponential, temp, sc_out, sc_keep if sc_keep is not None else temp, stats, idx,
        vocab, canvas, num_chunks, vocab, vocab, vocab, softcap, HAS_KEEP=sc_keep is not None,
        SOFTCAP=softcap > 0, SC_BF16=sc_out.dtype == torch.bfloat16, CHUNK=chunk, BLOCK=block,
        INTERPRETED=_INTERPRETED, num_warps=num_warps)
    launcher(propose_merge_kernel)[(rows,)](
        stats, idx, sample, argmax, entropy, num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1)
    return sample, argmax, entropy


def _canvas_propose_fake(
    logits: torch.Tensor, exponential: torch.Tensor, temp: torch.Tensor, sc_out: torch.Tensor,
    sc_keep: torch.Tensor | None, softcap: float, chunk: int, block: int, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = logits.shape[:-1]
    return (logits.new_empty(lead, dtype=torch.int64), logits.new_empty(lead, dtype=torch.int64),
            logits.new_empty(lead, dtype=torch.float32))


_canvas_propose_op = traced_triton_op("dlmc::canvas_propose", _canvas_propose_impl,
                                      _canvas_propose_fake, mutates_args=("sc_out",))


def canvas_propose(
    logits: torch.Tensor, exponential: torch.Tensor, temp: torch.Tensor, sc_out: torch.Tensor,
    sc_keep: torch.Tensor | None = None, softcap: float = 0.0,
    tiles: ProposeTiles = DEFAULT_TILES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's proposal (Triton, `dlmc::canvas_propose`); writes the next self-conditioning
    input into `sc_out` in place.

    logits: fp32 or bf16 `[..., C, V]` (contiguous): the soft-capped logits, or with `softcap`
    > 0 the values before the cap (`tanh(x / softcap) * softcap` is taken in fp32 inside);
    exponential: fp32 `[..., C, V]`; temp: fp32 `[]`; sc_out: bf16 or fp32 `[..., C, V]`;
    sc_keep: bool `[...]` (the leading dims) or None: rows of a set entry keep `sc_out`. All on
    one device. tiles: the first launch's work split (`ProposeTiles`). Returns `(sample,
    argmax, entropy)`, `[..., C]` int64, int64 and fp32. Runs on CUDA and under
    `TRITON_INTERPRET=1`; elsewhere the reference.
    """
    shape = tuple(logits.shape)
    if logits.dim() < 2 or logits.dtype not in _SC_DTYPES or not logits.is_contiguous():
        raise ValueError(f"canvas_propose: logits must be contiguous fp32 or bf16 [..., C, V], "
                         f"got {logits.dtype} {shape}")
    if not (softcap >= 0 and softcap < float("inf")):
        raise ValueError(f"canvas_propose: softcap must be a finite number >= 0 (0: the logits "
                         f"are capped already), got {softcap}")
    for name, tensor, dtypes in (("exponential", exponential, (torch.float32,)),
                                 ("sc_out", sc_out, _SC_DTYPES)):
        if tuple(tensor.shape) != shape or tensor.dtype not in dtypes or not (
                tensor.is_contiguous()):
            raise ValueError(f"canvas_propose: {name} must be contiguous "
                             f"{' or '.join(map(str, dtypes))} {shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
    if temp.dim() != 0 or temp.dtype != torch.float32:
        raise ValueError(f"canvas_propose: temp must be a fp32 [] tensor, got {temp.dtype} "
                         f"{tuple(temp.shape)}")
    if sc_keep is not None and (sc_keep.dtype != torch.bool
                                or tuple(sc_keep.shape) != shape[:-2]):
        raise ValueError(f"canvas_propose: sc_keep must be bool {shape[:-2]}, got "
                         f"{sc_keep.dtype} {tuple(sc_keep.shape)}")
    tensors = [exponential, temp, sc_out] + ([] if sc_keep is None else [sc_keep])
    if any(t.device != logits.device for t in tensors):
        raise ValueError("canvas_propose: every tensor must be on the logits' device "
                         f"({logits.device})")
    if not (logits.is_cuda or _INTERPRETED):
        return canvas_propose_reference(logits, exponential, temp, sc_out, sc_keep, softcap)
    keep = None if sc_keep is None else sc_keep.contiguous()
    return _canvas_propose_op(logits, exponential, temp, sc_out, keep, float(softcap),
                              tiles.chunk, tiles.block, tiles.num_warps)
