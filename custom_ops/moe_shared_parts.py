"""The BF16 shared expert of `dlmc::nvfp4_moe` in parts about the size of an FP4 program.

Every token takes the shared expert, so its rows need no routing: part `p` of a launch covers
tokens `[c * BLOCK_M, (c + 1) * BLOCK_M)` with `c = p // SPLIT` and the `BLOCK_N / SPLIT`
columns `(p % SPLIT)` of each N-tile. Gate/up parts store `h` at rows `h_row0 + token` (a
region after the routed slots), down parts read them there and store `y` at the token's shared
pair `t * (K+1) + K`. The routing's shared blocks (`moe_align`'s tail) then have nothing to do.

Why: as whole M-block x N-tile programs (one per routing block), each LLaDA2.1-mini shared
gate/up program would read 1 MB of BF16 weights against 288 KB for an FP4 one, and the launch
would wait for them; parts of about an FP4 program's bytes finish with the FP4 programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dlmc.custom_ops.bf16_moe import bf16_down_rows, bf16_gate_up_rows

__all__ = ["shared_block_k", "shared_down_part", "shared_gate_up_part", "shared_parts",
           "shared_split"]


def shared_block_k(k: int) -> int:
    """K-tile of the BF16 shared-expert parts (`bf16_moe.bf16_tile_dot`) over a reduction of
    length `k`: 128 (16 / 8 KB of weights per step at 32 columns: the FP4-only kernels keep
    their registers and shared memory on sm_90), shorter for small `k`."""
    return min(128, max(16, triton.next_power_of_2(k)))


def shared_split(block_n: int) -> int:
    """Column parts per N-tile: 4, fewer for narrow tiles (a part keeps >= 16 columns)."""
    return max(1, min(4, block_n // 16))


def shared_parts(tokens: int, block_m: int, block_n: int) -> int:
    """Parts (extra programs per N-tile) that cover `tokens` rows of the shared expert."""
    return -(-tokens // block_m) * shared_split(block_n)


@triton.jit
def _part_rows(part, pid_n, num_pairs, pairs_per_token, N: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Tokens `[BM]` of `part`, their mask (< T), shared pair ids and the part's columns."""
    PART_N: tl.constexpr = BLOCK_N // SPLIT
    tokens = (part // SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = tokens < num_pairs // pairs_per_token
    pairs = tokens * pairs_per_token + (pairs_per_token - 1)
    n_offs = pid_n * BLOCK_N + (part % SPLIT) * PART_N + tl.arange(0, PART_N)
    return tokens, row_mask, pairs, n_offs, n_offs < N


@triton.jit
def shared_gate_up_part(a_ptr, gate_w, up_w, h_ptr, part, pid_n, num_pairs, pairs_per_token,
                        a_row_div, h_row0, H: tl.constexpr, I: tl.constexpr, stride_a, stride_h,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """h rows `h_row0 + t` of one part: `bf16_gate_up_rows` with A row `pair // a_row_div`."""
    tokens, row_mask, pairs, n_offs, n_mask = _part_rows(
        part, pid_n, num_pairs, pairs_per_token, I, BLOCK_M, BLOCK_N, SPLIT)
    a_rows = tl.where(row_mask, pairs // a_row_div, 0)
    bf16_gate_up_rows(a_ptr, a_rows, row_mask, gate_w, up_w, h_ptr, h_row0 + tokens, n_offs,
                      n_mask, H, stride_a, stride_h, BLOCK_K, INTERPRETED, "silu")


@triton.jit
def shared_down_part(h_ptr, down_w, y_ptr, part, pid_n, num_pairs, pairs_per_token, h_row0,
                     H: tl.constexpr, I: tl.constexpr, stride_h, stride_y, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """y at the shared pairs of one part's tokens: `bf16_down_rows` of h rows `h_row0 + t`."""
    tokens, row_mask, pairs, n_offs, n_mask = _part_rows(
        part, pid_n, num_pairs, pairs_per_token, H, BLOCK_M, BLOCK_N, SPLIT)
    bf16_down_rows(h_ptr, h_row0 + tokens, row_mask, down_w, y_ptr, pairs, n_offs, n_mask, I,
                   stride_h, stride_y, BLOCK_K, INTERPRETED)
