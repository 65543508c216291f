"""Launch of `dlmc::paged_attention`'s split and merge kernels, and the variants of the launch.

`default_variant` picks the op's launch (measured per cache type on the H200); the other
settings are latency experiments that perf/bench_paged_attention.py --sweep times by name
(`SWEEP_VARIANTS`) and that a caller may pass as the op's `variant`. Every variant computes the
same attention (tests/custom_ops/test_paged_attention*.py compare each with the reference).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from dlmc.custom_ops._pdl import launcher
from dlmc.custom_ops._registration import INTERPRETED
from dlmc.errors import ConfigError

from ._paged_attention_kernels import paged_attention_split_kernel, split_launch_config
from ._paged_attention_merge import (
    flat_merge_config,
    merge_chunk,
    paged_attention_merge_flat_kernel,
    paged_attention_merge_kernel,
)

# Fewest cached keys one contiguous split attends: fewer, longer splits when the prefix is short.
DEFAULT_MIN_SPLIT_KEYS = 128
SPLIT_ORDERS = ("contiguous", "interleaved")
MERGES = ("chunked", "masked", "speculative")


@dataclass(frozen=True)
class PagedAttentionVariant:
    """Launch options of the paged-attention kernels (`default_variant` picks the op's own;
    the field defaults are the contiguous-split launch).

    Attributes:
        num_splits: cache splits (0: `default_num_splits`; the op's `num_splits` wins if set).
        min_split_keys: fewest cached keys per contiguous split (0: DEFAULT_MIN_SPLIT_KEYS).
        tile: `(BLOCK_M, BLOCK_N, num_warps)` of the split kernel (None: `split_launch_config`).
        num_stages: pipelining stages of the key loop (0: 3 for head dim <= 128, else 2).
        own_stages: pipelining stages of the block's own-key loop (0: as num_stages). Its BF16
            buffers set the split kernel's shared memory: 1 stage instead of 3 takes it from
            112 to 64 KB at D=128 (sm_90), so 3 programs fit on an SM instead of 2.
        split_order: `"contiguous"` (each split a chunk of keys) or `"interleaved"` (split `s`
            takes key tiles `s, s + S, ...`; without a window the first tile's page ids and K/V
            are loaded before the prefix length arrives). Interleaved needs a flat merge.
        speculative_tiles: tiles per split loaded before the prefix is known (1 or 2;
            interleaved only).
        merge: `"chunked"` (own part, then prefix, then the live parts: three dependent round
            trips), `"masked"` (prefix with the own part, then all live parts: two) or
            `"speculative"` (all parts with the prefix, dead ones dropped: one).
        merge_rows: rows per merge program (flat merges; a power of two up to 16).
        partial_dtype: `torch.float32` or `torch.bfloat16` partial outputs (LSEs stay fp32).
        fp8_dot_f16: FP8 cache tiles and q as FP16 dot operands (one conversion per pair; an
            FP8 cache only, BF16 caches keep BF16; q must stay below 65504 in magnitude).
        pdl: launch both kernels with programmatic dependent launch (flat merges; sm_90+):
            each may start while the kernel before it finishes and waits for it on the
            device (griddepcontrol), hiding launch gaps. Eager or graph-captured launches
            only, not under torch.compile (Inductor drops launch_pdl); off in the interpreter.
    """

    num_splits: int = 0
    min_split_keys: int = 0
    tile: tuple[int, int, int] | None = None
    num_stages: int = 0
    own_stages: int = 0
    split_order: str = "contiguous"
    speculative_tiles: int = 1
    merge: str = "chunked"
    merge_rows: int = 1
    partial_dtype: torch.dtype = torch.float32
    fp8_dot_f16: bool = False
    pdl: bool = False

    def __post_init__(self) -> None:
        def check(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(f"PagedAttentionVariant: {message}")

        check(self.num_splits >= 0, f"num_splits must be >= 0, got {self.num_splits}")
        check(self.min_split_keys >= 0,
              f"min_split_keys must be >= 0, got {self.min_split_keys}")
        check(self.num_stages >= 0, f"num_stages must be >= 0, got {self.num_stages}")
        check(self.own_stages >= 0, f"own_stages must be >= 0, got {self.own_stages}")
        check(self.split_order in SPLIT_ORDERS,
              f"split_order={self.split_order!r} is not one of {SPLIT_ORDERS}")
        check(self.merge in MERGES, f"merge={self.merge!r} is not one of {MERGES}")
        check(self.speculative_tiles in (1, 2),
              f"speculative_tiles must be 1 or 2, got {self.speculative_tiles}")
        check(self.speculative_tiles == 1 or self.split_order == "interleaved",
              "speculative_tiles=2 needs split_order='interleaved'")
        flat = self.merge != "chunked"
        check(flat or self.split_order == "contiguous",
              "split_order='interleaved' needs merge='masked' or 'speculative'")
        check(flat or (self.merge_rows == 1 and not self.pdl),
              "merge_rows and pdl need merge='masked' or 'speculative'")
        check(self.merge_rows in (1, 2, 4, 8, 16),
              f"merge_rows must be a power of two from 1 to 16, got {self.merge_rows}")
        check(self.partial_dtype in (torch.float32, torch.bfloat16),
              f"partial_dtype must be torch.float32 or torch.bfloat16, got {self.partial_dtype}")


DEFAULT_VARIANT = PagedAttentionVariant()
_MERGE_SPEC = PagedAttentionVariant(merge="speculative")
_INTERLEAVED = PagedAttentionVariant(num_splits=32, split_order="interleaved",
                                     speculative_tiles=2, own_stages=1, merge="speculative")
# Variants perf/bench_paged_attention.py --sweep times, by name; each builds on the one above it
# in its group. The tests compare every one with the reference. The 32 splits of the interleaved
# ones are for an H200 at LLaDA2.1-mini shapes (33 x 8 programs = 2 per SM; 4k keys = 2 tiles
# per split, both loaded before the prefix arrives).
SWEEP_VARIANTS: dict[str, PagedAttentionVariant] = {
    "base": DEFAULT_VARIANT,
    "merge-masked": PagedAttentionVariant(merge="masked"),
    "merge-spec": _MERGE_SPEC,
    "merge-spec-r4": dataclasses.replace(_MERGE_SPEC, merge_rows=4),
    "merge-spec-own1": dataclasses.replace(_MERGE_SPEC, own_stages=1),
    "ilv32": _INTERLEAVED,
    "ilv32-bf16part": dataclasses.replace(_INTERLEAVED, partial_dtype=torch.bfloat16),
    "ilv32-f16dot": dataclasses.replace(_INTERLEAVED, fp8_dot_f16=True),
    "ilv32-pdl": dataclasses.replace(_INTERLEAVED, pdl=True),
    # half the partials for the merge to read (8.6 MB at 4k with 32 splits, fp32), twice the
    # tiles per split
    "ilv16": dataclasses.replace(_INTERLEAVED, num_splits=16),
    "ilv16-bf16part": dataclasses.replace(_INTERLEAVED, num_splits=16,
                                          partial_dtype=torch.bfloat16),
    # a quarter of the partials: at a 1k prefix (16 tiles of 64 keys) each split's two
    # speculative tiles are all its keys; as fast as ilv16 there, 7.5 µs slower at 4k
    "ilv8": dataclasses.replace(_INTERLEAVED, num_splits=8),
    # DiffusionGemma's canvas (256 queries): `split_launch_config`'s tile at D = 512 (64, 32,
    # 8 warps) and at D = 256 (4 warps), each the other head dim's alternative; larger tiles,
    # 3 stages and fewer splits lost at both (docs/paged_attention.md)
    "t64x32w8": PagedAttentionVariant(tile=(64, 32, 8)),
    "t64x32w4": PagedAttentionVariant(tile=(64, 32, 4)),
}


def default_variant(kv_dtype: torch.dtype, head_dim: int,
                    device: torch.device) -> PagedAttentionVariant:
    """The launch a call gets unless it names one: on CUDA, an FP8 cache at head dim 128 takes
    the interleaved splits, faster there at 4k and 16k prefixes; head dims of 256 and more
    (DiffusionGemma; the interleaved kernel spills registers there) take the contiguous splits
    with the flat speculative merge, 7-12 % faster at its canvas shapes with either cache; BF16
    caches at smaller head dims, and the CPU, keep the contiguous splits with the chunked merge
    (docs/paged_attention.md)."""
    if device.type != "cuda":
        return DEFAULT_VARIANT
    if head_dim >= 256:
        return _MERGE_SPEC
    if kv_dtype == torch.float8_e4m3fn and head_dim == 128:
        return _INTERLEAVED
    return DEFAULT_VARIANT


def default_num_splits(num_rows: int, num_kv_heads: int, block_m: int,
                       device: torch.device) -> int:
    """Key splits of the cached prefix: about two waves of programs on the GPU, 4 on CPU.

    Depends only on shapes and the device, never on the prefix length (graph safety); splits
    that find no keys exit at once.
    """
    if device.type != "cuda":
        return 4
    programs = math.ceil(num_rows / block_m) * num_kv_heads
    return max(1, min(math.ceil(2 * _sm_count(device.index) / programs), 64))


def append_tile_tokens(head_dim: int) -> int:
    """Tokens the appending split stores per step: 4096 elements of K (and of V) per step, at
    most 64 tokens (32 at D=128). Its registers are dead by then: the split kernel's count on
    sm_90 stays within 2 of the pure one's (tests/custom_ops/test_kernels_compile_sm90.py)."""
    return min(64, 4096 // head_dim)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_paged_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, prefix_len: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, softmax_scale: float, window: int,
    causal_block: int, num_splits: int, variant: PagedAttentionVariant | None = None,
    append: bool = False, window_per_query: bool = False,
) -> torch.Tensor:
    """Launch the split and merge kernels (arguments as in `paged_attention`; 0 = unset;
    `variant` None = `default_variant`). `append`: the split kernel also stores `k_new`/`v_new`
    in the caches at `prefix_len ..` (as `dlmc::kv_append`), mutating `k_cache`/`v_cache`.
    `window_per_query` (with a window): each query's window starts at its own position."""
    if window_per_query and window <= 0:
        raise ConfigError("paged_attention: window_per_query=True needs a window")
    num_queries, num_q_heads, head_dim = q.shape
    variant = variant or default_variant(k_cache.dtype, head_dim, q.device)
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_rows = num_queries * group
    capacity = min(num_pages, page_table.numel()) * page_size
    block_m, block_n, num_warps = variant.tile or split_launch_config(head_dim)
    num_splits = (num_splits or variant.num_splits
                  or default_num_splits(num_rows, num_kv_heads, block_m, q.device))
    min_split_keys = max(block_n, math.ceil((variant.min_split_keys or DEFAULT_MIN_SPLIT_KEYS)
                                            / block_n) * block_n)
    num_stages = variant.num_stages or (3 if head_dim <= 128 else 2)
    interleaved = variant.split_order == "interleaved"
    pdl = variant.pdl and not INTERPRETED
    if variant.pdl and torch.compiler.is_compiling():
        raise ConfigError("PagedAttentionVariant: pdl=True launches cannot be traced by "
                          "torch.compile (Inductor drops launch_pdl); call it eagerly or capture "
                          "it in a CUDA graph")
    parts = num_splits + 1
    o_part = torch.empty((parts, num_kv_heads, num_rows, head_dim), device=q.device,
                         dtype=variant.partial_dtype)  # [S+1, Hkv, M, D]
    lse_part = torch.empty((parts, num_kv_heads, num_rows), device=q.device,
                           dtype=torch.float32)  # [S+1, Hkv, M]
    out = torch.empty_like(q)  # [Tq, Hq, D]
    grid = (triton.cdiv(num_rows, block_m), num_kv_heads, parts)
    launch = {"launch_pdl": True} if pdl else {}
    launcher(paged_attention_split_kernel)[grid](
        q, k_new, v_new, k_cache, v_cache, page_table, prefix_len, k_scale, v_scale,
        o_part, lse_part,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_queries, num_rows, softmax_scale * math.log2(math.e), capacity, num_pages, window,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, CAUSAL_BLOCK=causal_block,
        NUM_SPLITS=num_splits, MIN_SPLIT_KEYS=min_split_keys, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_FP32=INTERPRETED, LOOP_WHILE=INTERPRETED,
        NUM_STAGES=num_stages, WINDOWED=window > 0, INTERLEAVED=interleaved,
        DOT_F16=variant.fp8_dot_f16 and k_cache.dtype == torch.float8_e4m3fn, PDL=pdl,
        OWN_STAGES=variant.own_stages or num_stages, SPEC_TILES=variant.speculative_tiles,
        APPEND=append, APPEND_T=append_tile_tokens(head_dim),
        EMULATE_FP8=INTERPRETED and k_cache.dtype == torch.float8_e4m3fn,
        WINDOW_PER_QUERY=window_per_query, num_warps=num_warps, **launch,
    )
    merge_args = (o_part, lse_part, out, prefix_len, out.stride(0), out.stride(1), num_rows,
                  capacity, window)
    if variant.merge == "chunked":
        launcher(paged_attention_merge_kernel)[(num_rows, num_kv_heads)](
            *merge_args, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            MIN_SPLIT_KEYS=min_split_keys, BLOCK_N=block_n, CHUNK=merge_chunk(num_splits),
            LOOP_WHILE=INTERPRETED, num_warps=4 if head_dim <= 256 else 8,
        )
        return out
    rows = variant.merge_rows
    chunk, merge_warps = flat_merge_config(num_splits, rows, head_dim)
    launcher(paged_attention_merge_flat_kernel)[(triton.cdiv(num_rows, rows), num_kv_heads)](
        *merge_args, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        MIN_SPLIT_KEYS=min_split_keys, BLOCK_N=block_n, INTERLEAVED=interleaved,
        SPECULATIVE=variant.merge == "speculative", ROWS=rows, CHUNK=chunk, PDL=pdl,
        num_warps=merge_warps, **launch,
    )
    return out
