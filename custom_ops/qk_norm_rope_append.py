"""`dlmc::qk_norm_rope_append`: `dlmc::qk_norm_rope` that also stores the block's K/V in a paged
cache, one Triton launch.

Without it, a round over the paged FP8 cache runs `qk_norm_rope`, then `kv_append` to store
the k it has just made and the v it has just copied: two launches per layer. Here the
program that makes token t's k head h (or copies its v head h) also writes that row at sequence
position `offset + t` of the cache, quantized as `kv_append` quantizes
(`e4m3(clamp(x / scale, ±448))` for FP8 pools, as is for BF16): the norm/rope code is
`qk_norm_rope_row`, the store `kv_append`'s `cache_slots` and `_store_cache_tile`. Positions
from the pools' capacity (`min(num_pages, page_table.numel()) * page_size`) on are dropped, as
`kv_append` drops them. The maths is `qk_norm_rope_append_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher, pdl_enter
from dlmc.custom_ops._registration import INTERPRETED, traced_triton_op
from dlmc.custom_ops.kv_append import (
    _store_cache_tile,
    cache_slots,
    check_cache_args,
    kv_append_reference,
)
from dlmc.custom_ops.qk_norm_rope import (
    QKV,
    new_qkv,
    qk_norm_rope_args,
    qk_norm_rope_reference,
    qk_norm_rope_row,
    qkv_layout,
)

__all__ = ["qk_norm_rope_append", "qk_norm_rope_append_reference"]


@triton.jit
def qk_norm_rope_append_kernel(
    qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr,
    v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr, v_scale_ptr, eps, stride_t, stride_s,
    stride_cp, stride_cs, stride_ch, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MAX_TOKENS: tl.constexpr, QUANTIZE: tl.constexpr, EMULATE_FP8: tl.constexpr,
    SPLITS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    row = qk_norm_rope_row(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
                           v_ptr, eps, stride_t, stride_s, token, head, NUM_Q, NUM_KV,
                           HEAD_DIM, ROTARY, SPLITS)  # [D] bf16, the k or v row just stored
    if head >= NUM_Q:
        is_v = head >= NUM_Q + NUM_KV
        kv_head = head - NUM_Q - tl.where(is_v, NUM_KV, 0)
        pos = tl.load(offset_ptr) + token  # position in the sequence
        d = tl.arange(0, HEAD_DIM)
        valid = (d * 0 + pos) < MAX_TOKENS  # [D]: the whole row, or nothing past capacity
        dst = cache_slots(page_table_ptr, pos, pos < MAX_TOKENS, kv_head, stride_cp, stride_cs,
                          stride_ch, PAGE_SIZE)
        _store_cache_tile(tl.where(is_v, v_cache_ptr, k_cache_ptr), dst + d, row,
                          tl.where(is_v, v_scale_ptr, k_scale_ptr), valid, QUANTIZE, EMULATE_FP8)


def _qk_norm_rope_append_impl(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    (tokens, stride_s, splits), head_dim = qkv_layout(qkv), q_weight.shape[0]
    q, k, v = new_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    num_pages, page_size = k_cache.shape[:2]
    quantize = k_cache.dtype == torch.float8_e4m3fn
    if tokens:
        launcher(qk_norm_rope_append_kernel)[(tokens, num_q_heads + 2 * num_kv_heads)](
            qkv, q_weight, k_weight, cos, sin, q, k, v, k_cache, v_cache, page_table,
            offset, k_scale, v_scale, eps, qkv.stride(-2), stride_s, k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), NUM_Q=num_q_heads, NUM_KV=num_kv_heads,
            HEAD_DIM=head_dim, ROTARY=cos.shape[1],
            MAX_TOKENS=min(num_pages, page_table.numel()) * page_size, PAGE_SIZE=page_size,
            QUANTIZE=quantize, EMULATE_FP8=quantize and INTERPRETED, SPLITS=splits, num_warps=1)
    return q, k, v


def _qk_norm_rope_append_fake(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    """Fake function: new q, k, v (the caches are mutated in place, nothing to allocate)."""
    return new_qkv(qkv, num_q_heads, num_kv_heads, q_weight.shape[0])


_qk_norm_rope_append_op = traced_triton_op(
    "dlmc::qk_norm_rope_append", _qk_norm_rope_append_impl, _qk_norm_rope_append_fake,
    mutates_args=("k_cache", "v_cache"))


def qk_norm_rope_append(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    """`qk_norm_rope` (Triton) whose launch also stores the returned k and v in a paged cache.

    qkv, q_weight, k_weight, cos, sin, num_q_heads, num_kv_heads, eps: as `qk_norm_rope` (qkv
    bf16 `[T, (Hq + 2·Hkv)·D]` or fp32 partials `[S, T, ...]`, weights bf16 `[D]`, cos/sin bf16
    `[T, R]`). k_cache, v_cache: `[num_pages, page_size, Hkv, D]` float8_e4m3fn or bfloat16
    (mutated); page_table `[max_pages]` int32; offset a 1-element int32 device tensor; k_scale,
    v_scale 1-element float32: as `kv_append`. Returns `qk_norm_rope`'s bf16 `(q [T, Hq, D], k
    [T, Hkv, D], v [T, Hkv, D])`; token t's k/v rows, exactly these values, are stored at
    sequence position `offset + t` as `kv_append(k, v, ...)` stores them (bit for bit; positions
    past the pools' capacity dropped). No host sync.
    """
    args = qk_norm_rope_args("qk_norm_rope_append", qkv, q_weight, k_weight, cos, sin,
                             num_q_heads, num_kv_heads, eps)
    check_cache_args("qk_norm_rope_append", num_kv_heads, q_weight.shape[0], k_cache, v_cache,
                     page_table, offset, k_scale, v_scale)
    return torch.ops.dlmc.qk_norm_rope_append(
        *args, k_cache, v_cache, page_table, offset.reshape(1), k_scale.reshape(1),
        v_scale.reshape(1))


def qk_norm_rope_append_reference(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    """The maths of `qk_norm_rope_append`: `qk_norm_rope_reference`, then `kv_append_reference`
    of its k and v (syncs on `offset`)."""
    q, k, v = qk_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, num_q_heads,
                                     num_kv_heads, eps)
    kv_append_reference(k, v, k_cache, v_cache, page_table, offset, k_scale=k_scale,
                        v_scale=v_scale)
    return q, k, v
