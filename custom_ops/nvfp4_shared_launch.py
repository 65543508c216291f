"""The BF16 shared expert of `dlmc::nvfp4_moe` in a launch of its own, between the routed
experts' Gluon gate/up and down launches (`DLMC_NVFP4_SHARED_LAUNCH=own`).

With a shared expert (LLaDA2.x) the op otherwise keeps the shared expert in the routing
(`moe_align`'s shared tail) and its parts in the Triton gate/up launch, so the LLaDA round
never takes the routed experts' fastest path: the self-routed Gluon gate/up launched first and
the Gluon down kernel routing its own items, with no alignment launch (session 41: 85.9-86.6
against 87.5-88.6 µs per layer for the routed experts alone). Here the routed experts run
exactly that path, as if there were no shared expert (pairs `t*K + k`, x row `pair // K`),
except that the down kernel stores pair p at y row `p + p // K` (`PAIR_GAP`), leaving each
token's row `t*(K+1) + K` to the shared expert. The shared expert's gate/up and down parts
(`moe_shared_parts`, the same device functions and tiles as in the Triton gate/up launch, so
the same values bit for bit) run as one Triton launch (`_gate_up_kernel`'s `PARTS_ONLY` +
`SHARED_DOWN` form) placed between the two Gluon launches with `PDL_AFTER`: it lets the down
kernel launch at once and finishes only after gate/up has; the down kernel ends with
`griddepcontrol.wait`, so its completion implies this launch's, and the combine that follows
waits for the down kernel alone. The parts read only x, which the kernels before gate/up wrote;
their h rows and counters (after the routed blocks') and y rows are disjoint from the routed
kernels'.
"""

from __future__ import annotations

import torch
import triton

from dlmc.custom_ops._nvfp4_moe_kernels import _gate_up_kernel
from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.moe_shared_parts import shared_block_k, shared_parts, shared_split
from dlmc.env import env_choice

__all__ = ["SHARED_LAUNCH", "launch_shared_parts", "shared_launch_mode"]

# DLMC_NVFP4_SHARED_LAUNCH (read at import; tests and benches may set the module's value):
# "gate_up" (the default: the shared expert in the routing and in the Triton gate/up launch),
# "own" (this module's launch) or "items" (the shared expert as items of the two Gluon
# launches, `_nvfp4_shared_items`; at most 32 tokens, else "own").
SHARED_LAUNCH = env_choice("DLMC_NVFP4_SHARED_LAUNCH", "gate_up", ("gate_up", "own", "items"))


def shared_launch_mode() -> str:
    """`SHARED_LAUNCH` as now set."""
    return SHARED_LAUNCH


def launch_shared_parts(x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        routed: tuple[torch.Tensor, ...], h: torch.Tensor, y: torch.Tensor,
                        count: torch.Tensor, num_blocks: int, num_slots: int, top_k: int,
                        block_m: int, block_n1: int, block_n2: int) -> None:
    """The shared expert of every token: h rows `num_blocks * block_m + t` (gate/up parts),
    then y rows `t*(K+1) + K` (down parts, each after its token chunk's gate/up parts).

    x bf16 `[T, H]` (contiguous); `shared`: gate, up bf16 `[I, H]`, down bf16 `[H, I]`;
    `routed`: the routed gate/up arguments the kernel takes but does not read here
    (sorted_pair, expert_of_block, gate words, gate codes, up words, up codes, gate alpha,
    up alpha); h bf16 `[S, I]`; y bf16 `[T*(K+1), H]`; `count`: the op's `moe_overlap`
    counters (`num_slots` slots, the shared token chunks' after the `num_blocks` routed
    blocks'); `block_n1`, `block_n2`: the N-tiles of the Triton gate/up and down kernels,
    whose shared parts these are (`nvfp4_moe._launch_config`). Launched with PDL
    (`PDL_AFTER`; not under the CPU interpreter) right after the Gluon gate/up launch, before
    the Gluon down kernel."""
    T, H = x.shape
    I = h.shape[1]
    tiles1, tiles2 = triton.cdiv(I, block_n1), triton.cdiv(H, block_n2)
    parts1, parts2 = shared_parts(T, block_m, block_n1), shared_parts(T, block_m, block_n2)
    down = {"SHARED_DOWN": True, "y_ptr": y, "stride_y": y.stride(0), "shared_down_w": shared[2],
            "num_slots": num_slots, "gate_up_rows": parts1, "down_parts": parts2,
            "DOWN_TILES": tiles2, "DOWN_SPLIT": shared_split(block_n2),
            "DOWN_BLOCK_N": block_n2, "DOWN_BLOCK_K": shared_block_k(I, "down")}
    pairs_per_token = top_k + 1
    _gate_up_kernel[(tiles1, parts1 + triton.cdiv(parts2 * tiles2, tiles1))](
        x, *routed, h, T * pairs_per_token, pairs_per_token, H, I, x.stride(0), h.stride(0),
        shared[0], shared[1], routed[2].shape[0], num_blocks, pairs_per_token, count,
        BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=128, INTERPRETED=INTERPRETED,
        VARIANT=7,  # (BLOCK_K, VARIANT: the routed blocks' v7, not run here)
        SHARED=True, SHARED_BLOCK_K=shared_block_k(H, "gate_up"),
        SHARED_SPLIT=shared_split(block_n1), OVERLAP=True, H_EVEN_ODD=True, PARTS_ONLY=True,
        PDL=False, **down,
        **({} if INTERPRETED else {"PDL_AFTER": True, "launch_pdl": True}))
