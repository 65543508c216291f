"""`dlmc::qk_norm_rope`: LLaDA2's per-head query/key RMSNorm and partial rotary embedding, one
Triton launch.

The fused `query_key_value` projection gives `[T, (Hq + 2·Hkv)·D]`. Every query and key head is
RMS-normalised over its `D` dims (fp32 statistics, `w * bf16(x * rsqrt(mean(x²) + eps))`), then
its first `R` dims are rotated (`y·cos + rotate_half(y)·sin`, each product rounded to bf16 as
eager PyTorch does) with the round's cos/sin tables (`dlmc::rope_tables`); value heads are
copied out. Inductor makes four to six kernels of this
(a statistics reduction and a rotary pass per q and k, plus copies) because the rotation reads
across the reduced row; here one program holds a head's row and does all of it.
The maths is `qk_norm_rope_reference` (`rms_norm` + `apply_partial_rope`, which the model's
layers also use on CPU).

qkv may also come as `dlmc::split_k_linear`'s fp32 partials `[S, T, W]`: the kernel sums each
element's S partials (s = 0, 1, ... in fp32) and rounds the sum to bf16 as it reads it, so the
projection needs no reduction launch of its own (`qkv_partials_sum` is that sum in torch ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import traced_triton_op

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

__all__ = ["apply_partial_rope", "kernel_takes_qkv", "new_qkv", "qk_norm_rope",
           "qk_norm_rope_args", "qk_norm_rope_reference", "qk_norm_rope_row", "qkv_layout",
           "qkv_partials_sum", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`; the weight is used as is (not 1 + w)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of every head of `x [T, heads, D]`; the rest pass."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rotary_dim]
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


@triton.jit
def _bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32, by integer bit operations.

    Not `x.to(bf16).to(fp32)`: compiled for the H200, that round trip made some rotated
    elements differ from eager PyTorch's, while integer rounding matches bit for bit.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _qkv(row_ptr, offs, stride_s, SPLITS: tl.constexpr):
    """qkv[row, offs] as fp32: the bf16 element (`SPLITS` 0), or the bf16 rounding of the fp32
    sum of the `SPLITS` partials `stride_s` apart (s = 0, 1, ...)."""
    if SPLITS == 0:  # (no early return: Triton compiles the code after it for every SPLITS)
        value = tl.load(row_ptr + offs).to(tl.float32)
    else:
        acc = tl.load(row_ptr + offs)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(row_ptr + s * stride_s + offs)
        value = _bf16_rne(acc)
    return value


@triton.jit
def _normed(x_row_ptr, w_ptr, d, rstd, stride_s, SPLITS: tl.constexpr):
    """bf16 `w[d] * bf16(x[d] * rstd)` as fp32."""
    x = _qkv(x_row_ptr, d, stride_s, SPLITS)
    normed = _bf16_rne(x * rstd)
    return _bf16_rne(tl.load(w_ptr + d).to(tl.float32) * normed)


@triton.jit
def qk_norm_rope_row(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, eps,
                     stride_t, stride_s, token, head, NUM_Q: tl.constexpr,
                     NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
                     SPLITS: tl.constexpr):
    """The work of program (token, head) of `_qk_norm_rope_kernel` (heads: q, then k, then v):
    stores the row of q, k or v and returns it, bf16 `[HEAD_DIM]` (for kernels that also
    store it elsewhere, `dlmc::qk_norm_rope_append`). qkv is bf16 (`SPLITS` 0) or `SPLITS`
    fp32 partials `stride_s` apart (`_qkv`)."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + token * stride_t + head * HEAD_DIM
    if head >= NUM_Q + NUM_KV:  # value head: copied out contiguous
        out_row = v_ptr + (token * NUM_KV + head - NUM_Q - NUM_KV) * HEAD_DIM
        out = _qkv(row, d, stride_s, SPLITS).to(tl.bfloat16)  # exact: a bf16 value
    else:
        x = _qkv(row, d, stride_s, SPLITS)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)  # as torch.rsqrt on CUDA
        is_q = head < NUM_Q
        w_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
        y = _normed(row, w_ptr, d, rstd, stride_s, SPLITS)
        if ROTARY > 0:
            half: tl.constexpr = ROTARY // 2
            rot = d < ROTARY
            partner = tl.where(d < half, d + half, d - half)
            partner = tl.where(rot, partner, d)
            y_p = _normed(row, w_ptr, partner, rstd, stride_s, SPLITS)
            y_p = tl.where(d < half, -y_p, y_p)  # rotate_half
            c = tl.load(cos_ptr + token * ROTARY + d, mask=rot, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + token * ROTARY + d, mask=rot, other=0.0).to(tl.float32)
            y = tl.where(rot, _bf16_rne(_bf16_rne(y * c) + _bf16_rne(y_p * s)), y)
        out_row = tl.where(is_q, q_ptr + (token * NUM_Q + head) * HEAD_DIM,
                           k_ptr + (token * NUM_KV + head - NUM_Q) * HEAD_DIM)
        out = y.to(tl.bfloat16)  # exact: y holds a bf16 value
    tl.store(out_row + d, out)
    return out


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                         eps, stride_t, stride_s, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                         HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, SPLITS: tl.constexpr):
    qk_norm_rope_row(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, eps,
                     stride_t, stride_s, tl.program_id(0), tl.program_id(1), NUM_Q, NUM_KV,
                     HEAD_DIM, ROTARY, SPLITS)


def new_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int) -> QKV:
    """Uninitialised bf16 outputs `(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])` for `qkv`
    (`[T, W]` or partials `[S, T, W]`)."""
    tokens = qkv.shape[-2]
    return tuple(qkv.new_empty((tokens, heads, head_dim), dtype=torch.bfloat16)
                 for heads in (num_q_heads, num_kv_heads, num_kv_heads))


def kernel_takes_qkv(qkv: torch.Tensor) -> bool:
    """Whether the norm/rope kernels take `qkv`'s form: bf16 `[T, W]` or fp32 split-K
    partials `[S, T, W]` (an fp32 model's `[T, W]` is not: it runs the reference)."""
    return (qkv.dtype == torch.bfloat16 and qkv.dim() == 2
            or qkv.dtype == torch.float32 and qkv.dim() == 3 and qkv.shape[0] >= 1)


def qkv_layout(qkv: torch.Tensor) -> tuple[int, int, int]:
    """(tokens, the kernels' `stride_s`, `SPLITS`) of bf16 `[T, W]` (0, 0) or partials
    `[S, T, W]`."""
    if qkv.dim() == 2:
        return qkv.shape[0], 0, 0
    return qkv.shape[1], qkv.stride(0), qkv.shape[0]


def qkv_partials_sum(qkv: torch.Tensor) -> torch.Tensor:
    """bf16 `[T, W]` of `qkv`: itself, or the bf16 rounding of its partials' fp32 sum taken in
    order (s = 0, 1, ...), as the kernels read them."""
    if qkv.dim() == 2:
        return qkv
    total = qkv[0]
    for part in qkv[1:]:
        total = total + part
    return total.to(torch.bfloat16)


def _qk_norm_rope_impl(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                       num_kv_heads: int, eps: float) -> QKV:
    (tokens, stride_s, splits), head_dim = qkv_layout(qkv), q_weight.shape[0]
    q, k, v = new_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    if tokens:
        launcher(_qk_norm_rope_kernel)[(tokens, num_q_heads + 2 * num_kv_heads)](
            qkv, q_weight, k_weight, cos, sin, q, k, v, eps, qkv.stride(-2), stride_s,
            NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, ROTARY=cos.shape[1],
            SPLITS=splits, num_warps=1)
    return q, k, v


def _qk_norm_rope_fake(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                       num_kv_heads: int, eps: float) -> QKV:
    return new_qkv(qkv, num_q_heads, num_kv_heads, q_weight.shape[0])


_qk_norm_rope_op = traced_triton_op("dlmc::qk_norm_rope", _qk_norm_rope_impl, _qk_norm_rope_fake)


def qk_norm_rope_args(op: str, qkv: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_q_heads: int, num_kv_heads: int, eps: float) -> tuple:
    """`qk_norm_rope`'s inputs checked (a `ValueError` prefixed by `op` names the bad tensor)
    and laid out as its kernel reads them; shared with `dlmc::qk_norm_rope_append`."""
    head_dim = q_weight.shape[0]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if not kernel_takes_qkv(qkv) or qkv.shape[-1] != width:
        raise ValueError(f"{op}: qkv must be bf16 [T, {width}] or fp32 partials "
                         f"[S, T, {width}], got {qkv.dtype} {tuple(qkv.shape)}")
    tokens = qkv.shape[-2]
    if head_dim & (head_dim - 1) or k_weight.shape != q_weight.shape:
        raise ValueError(f"{op}: q/k norm weights must be [D] with D a power of two, "
                         f"got {tuple(q_weight.shape)} / {tuple(k_weight.shape)}")
    rotary = cos.shape[1]
    if cos.shape != sin.shape or cos.shape[0] != tokens or rotary % 2 or rotary > head_dim:
        raise ValueError(f"{op}: cos/sin must be [T={tokens}, R] with R even and "
                         f"<= {head_dim}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if qkv.dim() == 2 and qkv.stride(1) != 1 or qkv.dim() == 3 and not qkv.is_contiguous():
        qkv = qkv.contiguous()
    return (qkv, q_weight.to(torch.bfloat16),
            k_weight.to(torch.bfloat16), cos.to(torch.bfloat16).contiguous(),
            sin.to(torch.bfloat16).contiguous(), num_q_heads, num_kv_heads, float(eps))


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 eps: float) -> QKV:
    """Per-head RMSNorm of queries and keys, then partial rotary embedding (Triton).

    qkv bf16 `[T, (Hq + 2·Hkv)·D]` with unit stride in the last dim, or fp32 partials `[S, T,
    (Hq + 2·Hkv)·D]` (`dlmc::split_k_linear`'s) read as `qkv_partials_sum`; q_weight, k_weight
    bf16 `[D]` (D a power of two); cos, sin bf16 `[T, R]` (`R` even, at most D; 0 columns: no
    rotation; `dlmc::rope_tables`). Returns contiguous bf16 `(q [T, Hq, D], k [T, Hkv, D], v [T,
    Hkv, D])`, equal to `qk_norm_rope_reference` up to one bf16 step where the fp32 statistics
    (summed in another order, `rsqrt` approximate on the GPU) round the other way.
    No host sync.
    """
    return _qk_norm_rope_op(*qk_norm_rope_args("qk_norm_rope", qkv, q_weight, k_weight,
                                                cos, sin, num_q_heads, num_kv_heads, eps))


def qk_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                           num_kv_heads: int, eps: float
                           ) -> QKV:
    """The maths of `qk_norm_rope` in eager PyTorch (LLaDA2's RMSNorm + partial rope)."""
    head_dim = q_weight.shape[0]
    qkv = qkv_partials_sum(qkv)
    heads = qkv.view(qkv.shape[0], -1, head_dim)  # [T, Hq+2Hkv, D]
    q, k, v = heads.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    return (apply_partial_rope(rms_norm(q, q_weight, eps), cos, sin),
            apply_partial_rope(rms_norm(k, k_weight, eps), cos, sin), v.contiguous())
