"""`dlmc::attention_in` / `dlmc::attention_in_append`: the input half of a LLaDA2 attention
layer in one Triton launch: input RMSNorm, the `query_key_value` projection, per-head q/k
RMSNorm + partial RoPE and (the `_append` op) the block's K/V stored in a paged cache.

Separately these are an RMSNorm kernel, `dlmc::split_k_linear` and `dlmc::qk_norm_rope` (or
`dlmc::qk_norm_rope_append`): three launches per layer. How the one kernel splits the work:
custom_ops/_attention_in_kernel.py. The maths is `attention_in_reference` (and
`attention_in_append_reference`): `rms_norm`, `split_k_linear_reference` under this op's K
splits, `qk_norm_rope_reference` (then `kv_append_reference`), the separate ops' references.
The kernel differs from it only where an fp32 sum taken in another order (the two sums of
squares, the dot products) rounds a bf16 value the other way.
"""

from __future__ import annotations

import torch

from dlmc.custom_ops._attention_in_kernel import attention_in_splits, launch_attention_in
from dlmc.custom_ops._registration import INTERPRETED, traced_triton_op
from dlmc.custom_ops.kv_append import check_cache_args, kv_append_reference
from dlmc.custom_ops.qk_norm_rope import (
    QKV,
    new_qkv,
    qk_norm_rope_args,
    qk_norm_rope_reference,
    rms_norm,
)

__all__ = ["MAX_TOKENS", "attention_in", "attention_in_append", "attention_in_append_reference",
           "attention_in_reference", "counters_for", "takes_attention_in"]

MAX_TOKENS = 64  # the kernel holds all of a block's tokens in one tile


def _attention_in_impl(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
) -> QKV:
    return launch_attention_in(x, norm_weight, qkv_weight, q_weight, k_weight, cos, sin,
                               num_q_heads, num_kv_heads, eps, qk_eps, counters, None)


def _attention_in_fake(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
) -> QKV:
    """Fake function: new q, k, v (the counters end as they began)."""
    return new_qkv(x, num_q_heads, num_kv_heads, q_weight.shape[0])


def _attention_in_append_impl(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    return launch_attention_in(x, norm_weight, qkv_weight, q_weight, k_weight, cos, sin,
                               num_q_heads, num_kv_heads, eps, qk_eps, counters,
                               (k_cache, v_cache, page_table, offset, k_scale, v_scale))


def _attention_in_append_fake(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    """Fake function: new q, k, v (the caches are mutated in place, nothing to allocate)."""
    return new_qkv(x, num_q_heads, num_kv_heads, q_weight.shape[0])


_attention_in_op = traced_triton_op("dlmc::attention_in", _attention_in_impl,
                                    _attention_in_fake, mutates_args=("counters",))
_attention_in_append_op = traced_triton_op(
    "dlmc::attention_in_append", _attention_in_append_impl, _attention_in_append_fake,
    mutates_args=("counters", "k_cache", "v_cache"))


def takes_attention_in(x: torch.Tensor) -> bool:
    """Whether the kernel takes the residual stream `x`: bf16 `[T <= 64, H]`, on CUDA or under
    Triton's interpreter."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= MAX_TOKENS
            and (x.is_cuda or INTERPRETED))


def counters_for(num_q_heads: int, num_kv_heads: int, device: torch.device | str
                 ) -> torch.Tensor:
    """The zeroed int32 per-head counters the op needs (`[Hq + 2·Hkv]`; every launch leaves
    them zero). Launches that may run at the same time need counters of their own."""
    return torch.zeros(num_q_heads + 2 * num_kv_heads, dtype=torch.int32, device=device)


def _args(op: str, x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
          q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float,
          counters: torch.Tensor) -> tuple:
    """The inputs checked (a `ValueError` prefixed by `op` names the bad tensor) and laid out
    as the kernel reads them."""
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = q_weight.shape[0]
    if not takes_attention_in(x):
        raise ValueError(f"{op}: x must be bf16 [T <= {MAX_TOKENS}, H] on CUDA (or under "
                         f"TRITON_INTERPRET=1), got {x.dtype} {tuple(x.shape)} on {x.device}")
    hidden = x.shape[1]
    if norm_weight.shape != (hidden,):
        raise ValueError(f"{op}: norm_weight must be [{hidden}], got {tuple(norm_weight.shape)}")
    if (qkv_weight.dtype != torch.bfloat16
            or tuple(qkv_weight.shape) != (heads * head_dim, hidden)):
        raise ValueError(f"{op}: qkv_weight must be bf16 [{heads * head_dim}, {hidden}], got "
                         f"{qkv_weight.dtype} {tuple(qkv_weight.shape)}")
    if counters.dtype != torch.int32 or counters.numel() < heads:
        raise ValueError(f"{op}: counters must be int32 with >= {heads} elements (zeros; "
                         f"`counters_for`), got {counters.dtype} {tuple(counters.shape)}")
    # qk_norm_rope's checks of the q/k weights and the cos/sin tables, on a stand-in qkv
    stand_in = x.new_empty((x.shape[0], heads * head_dim))
    _, q_w, k_w, cos, sin, *_ = qk_norm_rope_args(op, stand_in, q_weight, k_weight, cos, sin,
                                                  num_q_heads, num_kv_heads, qk_eps)
    x = x if x.stride(1) == 1 else x.contiguous()
    return (x, norm_weight.to(torch.bfloat16).contiguous(), qkv_weight.contiguous(), q_w, k_w,
            cos, sin, num_q_heads, num_kv_heads, float(eps), float(qk_eps), counters)


def attention_in(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
) -> QKV:
    """q, k, v of a block from the residual stream, one launch (`dlmc::attention_in`).

    x: bf16 `[T <= 64, H]` (the layer's input, before its RMSNorm); norm_weight `[H]` and eps:
    the input RMSNorm; qkv_weight bf16 `[(Hq + 2·Hkv)·D, H]`; q_weight, k_weight, cos, sin,
    num_q_heads, num_kv_heads and qk_eps: as `qk_norm_rope`'s; counters: int32 `[>= Hq +
    2·Hkv]`, zeros (`counters_for`), mutated during the launch and left zero. Returns bf16
    `(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])` as `attention_in_reference` within the
    rounding the module docstring describes. No host sync.
    """
    return _attention_in_op(*_args("attention_in", x, norm_weight, qkv_weight, q_weight,
                                   k_weight, cos, sin, num_q_heads, num_kv_heads, eps, qk_eps,
                                   counters))


def attention_in_append(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float, counters: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, offset: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> QKV:
    """`attention_in` whose launch also stores the returned k and v in a paged cache
    (`dlmc::attention_in_append`): k_cache ... v_scale as `qk_norm_rope_append`'s (FP8 or
    BF16 pools, mutated); token t's k/v rows, exactly the returned values, are stored at
    sequence position `offset + t` as `kv_append(k, v, ...)` stores them (bit for bit;
    positions past the pools' capacity dropped). No host sync.
    """
    args = _args("attention_in_append", x, norm_weight, qkv_weight, q_weight, k_weight, cos,
                 sin, num_q_heads, num_kv_heads, eps, qk_eps, counters)
    check_cache_args("attention_in_append", num_kv_heads, q_weight.shape[0], k_cache, v_cache,
                     page_table, offset, k_scale, v_scale)
    return _attention_in_append_op(*args, k_cache, v_cache, page_table, offset.reshape(1),
                                   k_scale.reshape(1), v_scale.reshape(1))


def attention_in_partials(x: torch.Tensor, norm_weight: torch.Tensor,
                          qkv_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 partials `[S, T, W]` of `rms_norm(x) @ qkv_weight^T` under the op's K splits (as
    `split_k_linear_reference` splits its K)."""
    splits, per_split = attention_in_splits(x.shape[1])
    xs = rms_norm(x, norm_weight, eps).float().split(per_split, dim=1)
    ws = qkv_weight.float().split(per_split, dim=1)
    return torch.stack([xi @ wi.t() for xi, wi in zip(xs, ws, strict=True)])


def attention_in_reference(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float,
    counters: torch.Tensor | None = None,
) -> QKV:
    """The maths of `attention_in` in torch ops: the input `rms_norm`, the projection's fp32
    partials (`attention_in_partials`), `qk_norm_rope_reference` of them."""
    parts = attention_in_partials(x, norm_weight, qkv_weight, eps)
    return qk_norm_rope_reference(parts, q_weight, k_weight, cos, sin, num_q_heads,
                                  num_kv_heads, qk_eps)


def attention_in_append_reference(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, eps: float, qk_eps: float,
    counters: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> QKV:
    """The maths of `attention_in_append`: `attention_in_reference`, then
    `kv_append_reference` of its k and v (syncs on `offset`)."""
    q, k, v = attention_in_reference(x, norm_weight, qkv_weight, q_weight, k_weight, cos, sin,
                                     num_q_heads, num_kv_heads, eps, qk_eps)
    kv_append_reference(k, v, k_cache, v_cache, page_table, offset, k_scale=k_scale,
                        v_scale=v_scale)
    return q, k, v
