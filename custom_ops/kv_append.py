"""`dlmc::kv_append`: write a block's K/V into a paged cache at a device-tensor offset.

FP8 caches are quantized on write, `e4m3(clamp(x / scale, -448, 448))` (docs/nvfp4.md §2.7): a plain
cast does not saturate. BF16 caches store the values as they are (scales ignored). The offset is
a 1-element int32 device tensor, so the write is graph-capturable with a fixed block length;
tokens whose position would pass the table's capacity are dropped (the caller checks capacity
on the host, see `PagedKVCache.advance`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED, traced_triton_op
from dlmc.errors import ConfigError

FP8_MAX = 448.0
# Triton's CPU interpreter (tests): FP8 rounding is emulated there (see _e4m3_bits).


@triton.jit
def _e4m3_bits(x):
    """Round-to-nearest-even E4M3 code (uint8) of fp32 `x` already clamped to ±448.

    Used under the interpreter only: Triton 3.6's interpreter truncates FP8 casts without
    carrying into the exponent. Normals round on the fp32 bits (the carry ripples into the
    exponent); subnormals (|x| < 2^-6) round `|x| * 2^9` with the 2^23 magic number.
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    magnitude = tl.abs(x) * 512.0
    subnormal = ((magnitude + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def cache_slots(page_table_ptr, pos, valid, kv_head, stride_cp, stride_cs, stride_ch,
                PAGE_SIZE: tl.constexpr):
    """Element offsets `[N]` of sequence positions `pos` of `kv_head` in a paged pool: position
    `p` is `cache[page_table[p // PAGE_SIZE], p % PAGE_SIZE]` (page ids read where `valid`)."""
    page = tl.load(page_table_ptr + pos // PAGE_SIZE, mask=valid, other=0)
    return page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def _store_cache_tile(cache_ptr, offsets, x, scale_ptr, mask, QUANTIZE: tl.constexpr,
                      EMULATE_FP8: tl.constexpr):
    """Store BF16 `x` where `mask`: as is, or (QUANTIZE, an FP8 pool) `e4m3(clamp(x / scale,
    ±448))`; EMULATE_FP8 (the interpreter) rounds with `_e4m3_bits` and stores the codes
    through a uint8 view of the pool."""
    if QUANTIZE:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -448.0, 448.0)
        if EMULATE_FP8:
            x = _e4m3_bits(x)
            cache_ptr = cache_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def append_tokens(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr, v_scale_ptr,
    tok, head, num_tokens, max_tokens, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp,
    stride_cs, stride_ch, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    """Store tokens `tok` `[BT]` (those below `num_tokens`) of KV head `head` at positions
    `offset + tok`; positions from `max_tokens` on are dropped. The body of `kv_append_kernel`,
    shared with `dlmc::paged_attention_append`'s split kernel."""
    pos = tl.load(offset_ptr) + tok  # [BT] position in the sequence
    valid = (tok < num_tokens) & (pos < max_tokens)
    dst = cache_slots(page_table_ptr, pos, valid, head, stride_cp, stride_cs, stride_ch,
                      PAGE_SIZE)  # [BT]
    dims = tl.arange(0, HEAD_DIM)
    dst_ptrs = dst[:, None] + dims[None, :]  # [BT, D]
    mask = valid[:, None]
    k = tl.load(k_ptr + tok[:, None] * stride_kt + head * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok[:, None] * stride_vt + head * stride_vh + dims[None, :], mask=mask)
    _store_cache_tile(k_cache_ptr, dst_ptrs, k, k_scale_ptr, mask, QUANTIZE, EMULATE_FP8)
    _store_cache_tile(v_cache_ptr, dst_ptrs, v, v_scale_ptr, mask, QUANTIZE, EMULATE_FP8)


@triton.jit
def kv_append_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, offset_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_cs, stride_ch, num_tokens,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_TOKENS: tl.constexpr,
    QUANTIZE: tl.constexpr, EMULATE_FP8: tl.constexpr, BLOCK_T: tl.constexpr,
):
    append_tokens(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, offset_ptr,
                  k_scale_ptr, v_scale_ptr, tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T),
                  tl.program_id(1), num_tokens, MAX_TOKENS, stride_kt, stride_kh, stride_vt,
                  stride_vh, stride_cp, stride_cs, stride_ch, HEAD_DIM, PAGE_SIZE, QUANTIZE,
                  EMULATE_FP8)


def _kv_append_impl(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    num_pages, page_size = k_cache.shape[:2]
    capacity = min(num_pages, page_table.numel()) * page_size
    block_t = 16 if head_dim <= 256 else 8
    quantize = k_cache.dtype == torch.float8_e4m3fn
    launcher(kv_append_kernel)[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        k, v, k_cache, v_cache, page_table, offset, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_tokens,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, MAX_TOKENS=capacity,
        QUANTIZE=quantize, EMULATE_FP8=quantize and INTERPRETED, BLOCK_T=block_t,
    )


def kv_append_fake(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> None:
    """Fake function: the op only mutates the caches (nothing to allocate, no data read)."""


_kv_append_op = traced_triton_op("dlmc::kv_append", _kv_append_impl, kv_append_fake,
                                 mutates_args=("k_cache", "v_cache"))


def _check(cond: bool, message: str, op: str = "kv_append") -> None:
    if not cond:
        raise ConfigError(f"{op}: {message}")


def check_cache_args(
    op: str, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> None:
    """The checks of `kv_append`'s cache arguments for K/V of `[T, num_kv_heads, head_dim]`
    (a `ConfigError` prefixed by `op` names the bad tensor); shared with the ops that append
    from their own kernel (`dlmc::qk_norm_rope_append`)."""
    _check(k_cache.dim() == 4 and tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim)
           and k_cache.dtype in (torch.float8_e4m3fn, torch.bfloat16),
           f"k_cache must be [num_pages, page_size, {num_kv_heads}, {head_dim}] float8_e4m3fn "
           f"or bfloat16, got {tuple(k_cache.shape)} {k_cache.dtype}", op)
    _check(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
           and v_cache.stride() == k_cache.stride(), "v_cache must match k_cache", op)
    _check(k_cache.stride(-1) == 1, "the caches must be contiguous in the head dim", op)
    _check(page_table.dim() == 1 and page_table.dtype == torch.int32,
           f"page_table must be 1-D int32, got {tuple(page_table.shape)} {page_table.dtype}", op)
    _check(offset.numel() == 1 and offset.dtype == torch.int32,
           f"offset must be a 1-element int32 tensor, got {tuple(offset.shape)} {offset.dtype}",
           op)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(t.numel() == 1 and t.dtype == torch.float32,
               f"{name} must be a 1-element float32 tensor, got {tuple(t.shape)} {t.dtype}", op)


def kv_append(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, *, k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Store `T` tokens' K/V at sequence positions `offset .. offset+T-1` (in place).

    Args:
        k, v: `[T, Hkv, D]` bfloat16, contiguous in D.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]` float8_e4m3fn or bfloat16 (mutated).
        page_table: `[max_pages]` int32; position `p` goes to
            `cache[page_table[p // page_size], p % page_size]`.
        offset: 1-element int32 device tensor (read on the device, no host sync).
        k_scale, v_scale: 1-element float32 tensors; FP8 stores `e4m3(clamp(x / scale, ±448))`.
    """
    num_tokens = k.shape[0]
    _check(k.dim() == 3 and k.dtype == torch.bfloat16 and v.shape == k.shape
           and v.dtype == k.dtype, f"k and v must be [T, Hkv, D] bfloat16, got "
           f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    _check(k.stride(-1) == 1 and v.stride(-1) == 1, "k and v must be contiguous in the head dim")
    check_cache_args("kv_append", k.shape[1], k.shape[2], k_cache, v_cache, page_table, offset,
                     k_scale, v_scale)
    if num_tokens == 0:
        return
    torch.ops.dlmc.kv_append(k, v, k_cache, v_cache, page_table, offset.reshape(1),
                             k_scale.reshape(1), v_scale.reshape(1))


def quantize_kv_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the cache stores for `x`: FP8 `e4m3(clamp(x / scale, ±448))`, or `x` for BF16."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def kv_append_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, *, k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """`kv_append` in plain PyTorch (syncs on `offset`)."""
    page_size = k_cache.shape[1]
    capacity = min(k_cache.shape[0], page_table.numel()) * page_size
    positions = int(offset.reshape(-1)[0]) + torch.arange(k.shape[0], device=k.device)
    keep = positions < capacity
    positions = positions[keep]
    pages = page_table.reshape(-1)[positions // page_size].long()
    slots = positions % page_size
    k_cache[pages, slots] = quantize_kv_reference(k[keep], k_scale, k_cache.dtype)
    v_cache[pages, slots] = quantize_kv_reference(v[keep], v_scale, v_cache.dtype)
