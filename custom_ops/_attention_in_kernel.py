"""The kernel of `dlmc::attention_in` / `dlmc::attention_in_append` (custom_ops/attention_in.py):
the input half of a LLaDA2 attention layer in one launch.

Program `(head, split)` owns one head's `D` rows of the qkv weight and the K range `split` of
the hidden size, for all `T <= 64` tokens of the block:

- prologue: the fp32 sum of squares of every token's whole row of x (x is at most 64 x 2048
  bf16, read from L2 by every program), so the normalised x is rounded exactly as the plain
  path rounds it, `bf16(w * bf16(x * rstd))`;
- main loop: that normalised x times its weight slice, fp32 partials `[S, BLOCK_T, W]` (as
  `dlmc::split_k_linear` writes them) into a workspace;
- epilogue, by the last program of each head to finish (an int32 counter per head, incremented
  atomically and reset to 0 by that program, so a launch leaves `counters` as it found it): the
  partials summed in order (s = 0, 1, ...) and rounded to bf16, then `qk_norm_rope`'s maths on
  a `[T, D]` tile and, for k/v heads when appending, `kv_append`'s store (FP8 or BF16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.kv_append import _store_cache_tile, cache_slots
from dlmc.custom_ops.qk_norm_rope import QKV, _bf16_rne, _normed, _qkv, new_qkv
from dlmc.custom_ops.router_gemm import k_splits

__all__ = ["CONFIG", "attention_in_splits", "launch_attention_in"]

# (SPLITS, BLOCK_K, num_warps, num_stages): LLaDA2.1-mini's 24 heads x 8 K splits of 256 =
# 192 programs, each reading a 64 KB weight slice.
CONFIG = (8, 64, 4, 3)


@triton.jit
def fused_in_epilogue(
    part_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr,
    v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr, v_scale_ptr, qk_eps, tokens, head,
    stride_s, stride_cp, stride_cs, stride_ch, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MAX_POS: tl.constexpr, APPEND: tl.constexpr, QUANTIZE: tl.constexpr,
    EMULATE_FP8: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """`qk_norm_rope_row` (and `qk_norm_rope_append`'s store) of one head for all tokens at
    once: the `[BLOCK_T, D]` tile of qkv is the bf16 rounding of the in-order sum of the
    `SPLITS` fp32 partials at `part_ptr` (`[S, BLOCK_T, W]`, `stride_s` apart)."""
    W: tl.constexpr = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
    t = tl.arange(0, BLOCK_T)
    tmask = t < tokens
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]
    row = part_ptr + t[:, None] * W + head * HEAD_DIM  # [BT, 1]
    if head >= NUM_Q + NUM_KV:  # value head: the rounded sum, copied out
        out = _qkv(row, d, stride_s, SPLITS)
        out_ptr = v_ptr + (t[:, None] * NUM_KV + head - NUM_Q - NUM_KV) * HEAD_DIM + d
    else:
        x = _qkv(row, d, stride_s, SPLITS)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + qk_eps)[:, None]
        is_q = head < NUM_Q
        w_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
        y = _normed(row, w_ptr, d, rstd, stride_s, SPLITS)
        if ROTARY > 0:
            half: tl.constexpr = ROTARY // 2
            rot = d < ROTARY
            partner = tl.where(rot, tl.where(d < half, d + half, d - half), d)
            y_p = _normed(row, w_ptr, partner, rstd, stride_s, SPLITS)
            y_p = tl.where(d < half, -y_p, y_p)  # rotate_half
            cs_mask = rot & tmask[:, None]
            c = tl.load(cos_ptr + t[:, None] * ROTARY + d, mask=cs_mask, other=0.0)
            s = tl.load(sin_ptr + t[:, None] * ROTARY + d, mask=cs_mask, other=0.0)
            y = tl.where(rot, _bf16_rne(_bf16_rne(y * c.to(tl.float32))
                                        + _bf16_rne(y_p * s.to(tl.float32))), y)
        out = y
        q_off = (t[:, None] * NUM_Q + head) * HEAD_DIM + d
        k_off = (t[:, None] * NUM_KV + head - NUM_Q) * HEAD_DIM + d
        out_ptr = tl.where(is_q, q_ptr + q_off, k_ptr + k_off)
    out = out.to(tl.bfloat16)  # exact: out holds bf16 values
    tl.store(out_ptr, out, mask=tmask[:, None])
    if APPEND:  # noqa: SIM102 (a static condition around a runtime one)
        if head >= NUM_Q:
            is_v = head >= NUM_Q + NUM_KV
            kv_head = head - NUM_Q - tl.where(is_v, NUM_KV, 0)
            pos = tl.load(offset_ptr) + t  # [BT] positions in the sequence
            valid = tmask & (pos < MAX_POS)
            dst = cache_slots(page_table_ptr, pos, valid, kv_head, stride_cp, stride_cs,
                              stride_ch, PAGE_SIZE)  # [BT]
            _store_cache_tile(tl.where(is_v, v_cache_ptr, k_cache_ptr), dst[:, None] + d, out,
                              tl.where(is_v, v_scale_ptr, k_scale_ptr), valid[:, None],
                              QUANTIZE, EMULATE_FP8)


@triton.jit
def attention_in_kernel(
    x_ptr, norm_w_ptr, w_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, part_ptr, counter_ptr,
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr,
    v_scale_ptr, tokens, stride_x, eps, qk_eps, stride_cp, stride_cs, stride_ch,
    HIDDEN: tl.constexpr, K_PER_SPLIT: tl.constexpr, NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MAX_POS: tl.constexpr, APPEND: tl.constexpr,
    QUANTIZE: tl.constexpr, EMULATE_FP8: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_STATS: tl.constexpr,
    INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    split = tl.program_id(1)
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
    qk_eps = tl.cast(qk_eps, tl.float32)
    W: tl.constexpr = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
    t = tl.arange(0, BLOCK_T)
    tmask = t < tokens
    # input RMSNorm statistics over each token's whole row (padding rows: zeros)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_STATS):
        kk = k0 + tl.arange(0, BLOCK_STATS)
        xs = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :],
                     mask=tmask[:, None] & (kk[None, :] < HIDDEN), other=0.0).to(tl.float32)
        sq += tl.sum(xs * xs, axis=1)
    rstd = tl.math.rsqrt(sq / HIDDEN + eps)[:, None]  # [BT, 1]
    # this program's K range of (normalised x) @ W[head rows]^T
    n = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    acc = tl.zeros((BLOCK_T, HEAD_DIM), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kk = k_start + k0 + tl.arange(0, BLOCK_K)
        kmask = kk < HIDDEN
        xs = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :],
                     mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        g = tl.load(norm_w_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        xn = _bf16_rne(g * _bf16_rne(xs * rstd)).to(tl.bfloat16)  # exact: bf16 values
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * HIDDEN + kk[:, None],
                    mask=kmask[:, None], other=0.0)  # [BK, D]
        if INTERPRETED:  # the interpreter's bf16 dot is wrong: widen (exact products)
            acc = tl.dot(xn.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xn, w, acc)
    stride_s = BLOCK_T * W
    tl.store(part_ptr + split * stride_s + t[:, None] * W + n[None, :], acc)
    tl.debug_barrier()  # every thread's partials stored before the count (and the re-read)
    if SPLITS > 1:  # noqa: SIM108 (a static choice: one of the two is compiled)
        done = tl.atomic_add(counter_ptr + head, 1, sem="acq_rel")  # splits before this one
    else:
        done = 0
    if done == SPLITS - 1:  # the head's last program: all partials are in
        fused_in_epilogue(part_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                          k_cache_ptr, v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr,
                          v_scale_ptr, qk_eps, tokens, head, stride_s, stride_cp, stride_cs,
                          stride_ch, NUM_Q, NUM_KV, HEAD_DIM, ROTARY, PAGE_SIZE, MAX_POS,
                          APPEND, QUANTIZE, EMULATE_FP8, SPLITS, BLOCK_T)
        if SPLITS > 1:
            tl.atomic_xchg(counter_ptr + head, 0)  # ready for the next launch


def attention_in_splits(hidden: int) -> tuple[int, int]:
    """(S, K range per split) of the projection under `CONFIG` for a hidden size `hidden`."""
    return k_splits(hidden, CONFIG[0], CONFIG[1])


def launch_attention_in(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
    cache: tuple[torch.Tensor, ...] | None,
) -> QKV:
    """The bodies of both ops: new q, k, v from one `attention_in_kernel` launch; `cache`:
    `(k_cache, v_cache, page_table, offset, k_scale, v_scale)` to append to, or None."""
    tokens, hidden = x.shape
    head_dim = q_weight.shape[0]
    heads = num_q_heads + 2 * num_kv_heads
    q, k, v = new_qkv(x, num_q_heads, num_kv_heads, head_dim)
    if not tokens:
        return q, k, v
    splits, per_split = attention_in_splits(hidden)
    block_t = max(16, triton.next_power_of_2(tokens))
    part = x.new_empty((splits, block_t, heads * head_dim), dtype=torch.float32)
    if cache is None:  # (placeholder pointers: the APPEND branch is compiled out)
        k_cache = v_cache = q
        page_table = offset = counters
        k_scale = v_scale = norm_weight
        page_size, max_pos, quantize, strides = 1, 0, False, (0, 0, 0)
    else:
        k_cache, v_cache, page_table, offset, k_scale, v_scale = cache
        num_pages, page_size = k_cache.shape[:2]
        max_pos = min(num_pages, page_table.numel()) * page_size
        quantize = k_cache.dtype == torch.float8_e4m3fn
        strides = k_cache.stride()[:3]
    _, block_k, num_warps, num_stages = CONFIG
    launcher(attention_in_kernel)[(heads, splits)](
        x, norm_weight, qkv_weight, q_weight, k_weight, cos, sin, part, counters, q, k, v,
        k_cache, v_cache, page_table, offset, k_scale, v_scale, tokens, x.stride(0), eps,
        qk_eps, *strides, HIDDEN=hidden, K_PER_SPLIT=per_split,
        NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, ROTARY=cos.shape[1],
        PAGE_SIZE=page_size, MAX_POS=max_pos, APPEND=cache is not None, QUANTIZE=quantize,
        EMULATE_FP8=quantize and INTERPRETED, SPLITS=splits, BLOCK_T=block_t, BLOCK_K=block_k,
        BLOCK_STATS=min(triton.next_power_of_2(hidden), 8192 // block_t),
        INTERPRETED=INTERPRETED, num_warps=num_warps, num_stages=num_stages)
    return q, k, v


