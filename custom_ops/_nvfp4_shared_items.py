"""The BF16 shared expert as work items of the Gluon NVFP4 kernels: no launch of its own, and the
routed experts take their no-alignment path.

With a shared expert (LLaDA2.x) in the routing (`moe_align`'s shared tail) its parts run in the
Triton gate/up launch and a down launch of their own, and the routed experts cannot take their
fastest path (the self-routed Gluon gate/up launched first, the Gluon down kernel routing its
own items, no alignment launch). With these items (at most 32 tokens) the routed experts run
exactly that path, as if there were no shared expert (pairs `t*K + k`, x row `pair // K`),
except that the down kernel stores pair p at y row `p + p // K` (`PAIR_GAP`), leaving each
token's row `t*(K+1) + K` to the shared expert:

- Gate/up (`_nvfp4_gate_up_gluon`'s self-routed launch): the last `I / 32` programs of the
  grid take no routed item; program `grid - I/32 + j` runs shared item j, rows `32 j ..` of
  gate and up for every token (at most 32): per K-step of 64 the producer copies the gate and
  up tiles (bf16 [32, 64], 4 KB each, into the ring slot's two chunk buffers) and the tokens'
  x columns (bf16 [32, 64] into the slot's four 1 KB boxes); the consumers (2 x 2 warps over
  rows and tokens) multiply them (`mma_v2`, the weights as A, the tokens as B, fp32), store
  `SwiGLUMLP`'s bf16 `silu(g) * u` at h rows `h_row0 + t` (natural column order) and count
  the item done on the shared slot's counter. Items of half a routed item's bytes finish
  early, so the down kernel can take the shared items first.
- Down (`_nvfp4_down_gluon`'s self-routed launch): before the routed items, shared items
  `(16-token part, 128-row N-tile of H)`; per K-step of 32 the producer copies the down
  tile (bf16 [128, 32], the slot's weight buffer) and the part's h columns (bf16 [16, 32],
  one of the slot's h boxes), the first after the shared slot's `I / 32` counts; the
  consumers store `bf16(h @ down^T)` at y rows `t*(K+1) + K`.

Ring slots are tagged with `item * 1024 + SHARED_TAG`. The routed pair rows equal the Triton
kernels' bit for bit; the shared rows follow the Triton shared parts' bf16 maths but sum their
products in another order (GPU tests: equal up to that).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from dlmc.custom_ops._nvfp4_gluon_parts import (
    MMA,
    _fence_proxy_async_global,
    _store_tile,
    _tag_slot,
    _wait_live_rows,
)
from dlmc.custom_ops._nvfp4_gluon_ring import release_slot, wait_slot

__all__ = ["SHARED_TAG", "down_item_options", "gate_up_item_options", "gate_up_programs",
           "shared_down_copies", "shared_down_item", "shared_gate_up_copies",
           "shared_gate_up_item", "shared_items_apply"]

SHARED_TAG = gl.constexpr(1023)  # the expert field of a shared item's ring tag
ROWS_128 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                             rank=2))  # bf16 tiles of 64 columns
ROWS_64 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16,
                                            rank=2))  # bf16 tiles of 32 columns
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# gate/up items: [32 rows, 32 tokens] over 2 x 2 warps
MMA_22 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2],
                                                instr_shape=[16, 8]))
A_22 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA_22, k_width=2))
B_22 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA_22, k_width=2))


def gate_up_programs(inter: int) -> int:
    """The gate/up launch's programs of shared items: one per 32 rows of I."""
    return inter // 32


def shared_items_apply(tokens: int, hidden: int, inter: int) -> bool:
    """Whether the shared items take tokens, H and I: at most 32 tokens (one gate/up item
    covers them all), H a multiple of 128 and I of 32."""
    return 0 < tokens <= 32 and hidden % 128 == 0 and inter % 32 == 0


def gate_up_item_options(shared_items: tuple, x: torch.Tensor) -> dict:
    """The Gluon gate/up kernel's options for `launch_gate_up_gluon`'s `shared_items` (gate, up
    bf16 `[I, H]`, h row0, counter slot) and x bf16 `[T <= 32, H]`: gate, up and x in
    [32, 64] TMA boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gate, up, h_row0, slot = shared_items
    return {"SHARED_ITEMS": True, "shared_slot": slot, "h_row0": h_row0,
            "num_tokens": x.shape[0],
            **{name: TensorDescriptor.from_tensor(t, [32, 64], ROWS_128.value)
               for name, t in (("sg_d", gate), ("su_d", up), ("xs_d", x))}}


def down_item_options(shared_items: tuple, h: torch.Tensor) -> dict:
    """The Gluon down kernel's options for `launch_down_gluon`'s `shared_items` (down bf16
    `[H, I]`, h row0, counter slot, tokens): down in [128, 32] TMA boxes, h bf16 `[S, I]` in
    [16, 32] boxes, a shared item per 16 tokens and 128 rows of H, each waiting for the
    `gate_up_programs` counts on the slot."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    down, h_row0, slot, tokens = shared_items
    writers = gate_up_programs(down.shape[1])
    return {"SHARED_ITEMS": -(-tokens // 16) * (down.shape[0] // 128),
            "sd_d": TensorDescriptor.from_tensor(down, [128, 32], ROWS_64.value),
            "hs_d": TensorDescriptor.from_tensor(h, [16, 32], ROWS_64.value),
            "shared_slot": slot, "shared_writers": writers, "h_row0": h_row0,
            "num_tokens": tokens}


@gluon.jit
def _rows32(buf, s):
    """Ring slot s of a chunk buffer (bytes [64, 128]) as bf16 [32, 64] (its first half)."""
    return buf.index(s)._reinterpret(gl.bfloat16, [64, 64], ROWS_128).slice(0, 32)


@gluon.jit
def shared_gate_up_copies(sg_d, su_d, xs_d, j, i, empty, ready, g_buf, u_buf, h_buf, ids,
                          STAGES: gl.constexpr, H: gl.constexpr):
    """The producer's copies of shared gate/up item j into ring slots i, i + 1, ...; returns
    the ring position after it."""
    x_ring = h_buf._reinterpret(gl.bfloat16, [STAGES, 32, 64], ROWS_128)
    for k in range(H // 64):
        s = i % STAGES
        wait_slot(empty, i, STAGES)
        _tag_slot(ids, s, j * 1024 + SHARED_TAG)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * sg_d.block_type.nbytes + xs_d.block_type.nbytes)
        tma.async_copy_global_to_shared(sg_d, [j * 32, k * 64], bar, _rows32(g_buf, s))
        tma.async_copy_global_to_shared(su_d, [j * 32, k * 64], bar, _rows32(u_buf, s))
        tma.async_copy_global_to_shared(xs_d, [0, k * 64], bar, x_ring.index(s))
        i += 1
    return i


@gluon.jit
def shared_gate_up_item(h_ptr, count_ptr, shared_slot, h_row0, num_tokens, stride_h, j, i,
                        empty, ready, g_buf, u_buf, h_buf, STAGES: gl.constexpr,
                        H: gl.constexpr):
    """h rows `h_row0 + t` (t < num_tokens), columns `32 j + [0, 32)`: `bf16(bf16(silu(g)) *
    u)` with `g`, `u` the bf16-rounded `x @ gate^T`, `x @ up^T` (fp32 sums), then one count on
    `count_ptr[shared_slot]`; returns the ring position after the item."""
    x_ring = h_buf._reinterpret(gl.bfloat16, [STAGES, 32, 64], ROWS_128)
    acc_g = gl.zeros([32, 32], gl.float32, MMA_22)
    acc_u = gl.zeros([32, 32], gl.float32, MMA_22)
    for _ in range(H // 64):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        x = x_ring.index(s).permute([1, 0]).load(B_22)  # [64 K, 32 tokens]
        acc_g = mma_v2(_rows32(g_buf, s).load(A_22), x, acc_g)
        up = _rows32(u_buf, s).load(A_22)
        release_slot(empty, s)
        acc_u = mma_v2(up, x, acc_u)
        i += 1
    # `SwiGLUMLP`'s bf16 maths, as the Triton shared parts (`bf16_moe.bf16_gate_up_rows`):
    # g and u rounded to bf16, then silu(g) (tl.sigmoid's formula), then its product with u
    g = acc_g.to(gl.bfloat16).to(gl.float32)
    u = acc_u.to(gl.bfloat16).to(gl.float32)
    h = ((g * (1.0 / (1.0 + gl.exp(-g)))).to(gl.bfloat16).to(gl.float32) * u).to(gl.bfloat16)
    tokens = gl.arange(0, 32, gl.SliceLayout(0, MMA_22))
    cols = j * 32 + gl.arange(0, 32, gl.SliceLayout(1, MMA_22))
    _store_tile(h_ptr, h_row0 + tokens, stride_h, cols, h, tokens < num_tokens)
    gl.thread_barrier()  # every consumer thread's stores, then one release count
    gl.atomic_add(count_ptr + shared_slot, 1, sem="release", scope="gpu")
    return i


@gluon.jit
def shared_down_copies(sd_d, hs_d, count_ptr, num_slots, shared_slot, writers, readers, j,
                       h_row0, i, empty, ready, w_buf, h_buf, ids, tag, STAGES: gl.constexpr,
                       TILES: gl.constexpr, I: gl.constexpr):
    """The producer's copies of shared down item j (16-token part `j // TILES`, N-tile
    `j % TILES`): per K-step of 32 the down tile and the part's h columns, the first h copy
    after the shared gate/up items' `writers` counts (this warp one of `readers`); returns
    the ring position after it."""
    tile, part = j % TILES, j // TILES
    for k in gl.static_range(I // 32):
        s = i % STAGES
        wait_slot(empty, i, STAGES)
        _tag_slot(ids, s, tag)
        bar = ready.index(s)
        mbarrier.expect(bar, sd_d.block_type.nbytes + hs_d.block_type.nbytes)
        tma.async_copy_global_to_shared(
            sd_d, [tile * 128, k * 32], bar, w_buf.index(s)._reinterpret(gl.bfloat16, [128, 32],
                                                                         ROWS_64))
        if k == 0:
            _wait_live_rows(count_ptr, num_slots, shared_slot, 1, writers, readers)
            _fence_proxy_async_global()
        tma.async_copy_global_to_shared(
            hs_d, [h_row0 + 16 * part, k * 32], bar,
            h_buf.index(2 * s)._reinterpret(gl.bfloat16, [16, 32], ROWS_64))
        i += 1
    return i


@gluon.jit
def shared_down_item(y_ptr, stride_y, num_tokens, top_k, j, i, empty, ready, w_buf, h_buf,
                     STAGES: gl.constexpr, TILES: gl.constexpr, I: gl.constexpr):
    """y rows `t*(K+1) + K` of the item's 16 tokens (t < num_tokens), columns of its N-tile:
    `bf16(h @ down^T)`; returns the ring position after the item."""
    tile, part = j % TILES, j // TILES
    acc = gl.zeros([128, 16], gl.float32, MMA)
    for _ in gl.static_range(I // 32):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        h = h_buf.index(2 * s)._reinterpret(gl.bfloat16, [16, 32], ROWS_64).permute(
            [1, 0]).load(B_OP)  # [32 K, 16 tokens]
        w = w_buf.index(s)._reinterpret(gl.bfloat16, [128, 32], ROWS_64).load(A_OP)
        release_slot(empty, s)
        acc = mma_v2(w, h, acc)
        i += 1
    tokens = 16 * part + gl.arange(0, 16, gl.SliceLayout(0, MMA))
    cols = tile * 128 + gl.arange(0, 128, gl.SliceLayout(1, MMA))
    _store_tile(y_ptr, tokens * (top_k + 1) + top_k, stride_y, cols, acc.to(gl.bfloat16),
                tokens < num_tokens)
    return i
