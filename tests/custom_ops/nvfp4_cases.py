"""Cases of `dlmc::nvfp4_moe` shared by its tests: random experts and routings, the op's
arguments, the comparison with the reference, the stored forms the model keeps, and the
stand-in set-up for the Gluon kernels' wiring on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from dlmc.custom_ops import _nvfp4_moe_launch as launch
from dlmc.custom_ops import moe_overlap
from dlmc.custom_ops._nvfp4_moe_launch import effective_variant
from dlmc.custom_ops.nvfp4_moe import nvfp4_moe, nvfp4_moe_reference
from dlmc.custom_ops.nvfp4_moe_tiles import NVFP4Tiles, default_tiles
from dlmc.custom_ops.nvfp4_words import can_pack, stored_forms

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _v7_tiles(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
              variant: int, shared_in_routing: bool = False) -> NVFP4Tiles:
    """The tiles the op gives the shape's own kernel (v7's where the tiled layout takes it),
    whatever `variant` runs: v3's own choice (`block_m_for_many_pairs`, 64-wide gate/up
    N-tiles) would run other MMA and dot shapes, whose fp32 sums may round differently."""
    own = effective_variant(hidden, inter)  # (the function, not the patched attribute)
    return default_tiles(tokens, top_k, num_experts, hidden, inter, own, shared_in_routing)


@contextlib.contextmanager
def kernel_v3() -> Iterator[None]:
    """Kernel v3 on every shape (the op runs v7 where the tiled layout takes the shape), with
    the tiles v7 would take: the baseline v7 equals bit for bit."""
    previous = launch.effective_variant, launch.default_tiles
    launch.effective_variant, launch.default_tiles = (lambda hidden, inter: 3), _v7_tiles
    try:
        yield
    finally:
        launch.effective_variant, launch.default_tiles = previous


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # compares NaN and -0 bit for bit too


def stored(experts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `NVFP4Experts.prepare_for_kernel` stores: v7's tiled words and one-byte scale
    codes, or ModelOpt's forms where the shapes cannot be tiled (kernel v3)."""
    inter, hidden = experts["gate_weight"].shape[1], experts["down_weight"].shape[1]
    if not (can_pack(inter, hidden) and can_pack(hidden, inter)):
        return dict(experts)
    out = dict(experts)
    for proj in ("gate", "up", "down"):
        weight, scale = f"{proj}_weight", f"{proj}_weight_scale"
        out[weight], out[scale] = stored_forms(experts[weight], experts[scale], 7)
    return out


def random_experts(
    gen: torch.Generator, num_experts: int, hidden: int, inter: int, *,
    scale_2_log2: tuple[float, float] = (-4.0, 1.0), max_scale_byte: int = 0x7E,
) -> dict[str, torch.Tensor]:
    """Random packed experts: every E2M1 code (incl. -0), FP8 scales from 2^-9 up to 448."""
    tensors: dict[str, torch.Tensor] = {}
    for proj, (out_f, in_f) in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                ("down", (hidden, inter))):
        tensors[f"{proj}_weight"] = torch.randint(
            0, 256, (num_experts, out_f, in_f // 2), generator=gen, dtype=torch.uint8)
        scale_bytes = torch.randint(0, max_scale_byte + 1, (num_experts, out_f, in_f // 16),
                                    generator=gen, dtype=torch.uint8)  # positive, no NaN
        tensors[f"{proj}_weight_scale"] = scale_bytes.view(torch.float8_e4m3fn)
        low, high = scale_2_log2
        exponent = torch.rand(num_experts, generator=gen) * (high - low) + low
        tensors[f"{proj}_weight_scale_2"] = (2.0 ** exponent) * (
            1 + torch.rand(num_experts, generator=gen))
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def random_routing(gen: torch.Generator, tokens: int, num_experts: int, top_k: int,
                   skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `skew` sends every token to the first `top_k` experts."""
    if skew:
        ids = torch.arange(top_k).repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                           for _ in range(tokens)]) if tokens else torch.zeros(0, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids.long().to(DEVICE), weights.float().to(DEVICE)


def op_args(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[str, torch.Tensor]
            ) -> tuple[torch.Tensor, ...]:
    names = [f"{p}_{s}" for p in ("gate", "up", "down")
             for s in ("weight", "weight_scale", "weight_scale_2")]
    return (x, ids, w, *(experts[n] for n in names))


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 summation order (which can flip a bf16 rounding of h or y)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(ref.float()).all()
    scale = ref.float().abs().amax().clamp_min(1e-30)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * float(scale))


def shared_expert(gen: torch.Generator, x: torch.Tensor, routed: torch.Tensor, hidden: int,
                  inter: int) -> dict[str, torch.Tensor]:
    """Random BF16 shared-expert weights (`shared_*` kwargs), the down projection scaled by a
    power of two (exact) so that the shared output is as large as the routed output `routed`."""
    weights = {"shared_gate": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,
               "shared_up": torch.randn(inter, hidden, generator=gen) * hidden**-0.5,
               "shared_down": torch.randn(hidden, inter, generator=gen) * inter**-0.5}
    weights = {name: w.bfloat16().to(DEVICE) for name, w in weights.items()}
    g = torch.nn.functional.linear(x, weights["shared_gate"])
    y = torch.nn.functional.linear(torch.nn.functional.silu(g) * torch.nn.functional.linear(
        x, weights["shared_up"]), weights["shared_down"]).float()
    ratio = routed.float().abs().amax().clamp_min(1e-30) / y.abs().amax().clamp_min(1e-30)
    weights["shared_down"] *= 2.0 ** float(torch.log2(ratio).round().clamp(-100, 100))
    return weights


def run_case(seed: int, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
             skew: bool, scale_2_log2: tuple[float, float] = (-4.0, 1.0),
             x_scale: float = 1.0, activation: str = "silu", **options: object) -> None:
    """Random experts and routing: the op (its `activation`, launch `options` such as `tiles`)
    against the reference."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter, scale_2_log2=scale_2_log2)
    x = (torch.randn(tokens, hidden, generator=gen) * x_scale).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, num_experts, top_k, skew)
    args = op_args(x, ids, w, experts)
    assert_matches_reference(nvfp4_moe(*args, activation=activation, **options),
                             nvfp4_moe_reference(*args, activation=activation))


def run_shared_case(seed: int, tokens: int, num_experts: int, used: int, top_k: int,
                    hidden: int, inter: int, emulate_w4a4: bool = False,
                    alone: bool = False) -> None:
    """The shared expert (the BF16 parts of `moe_shared_parts`) against the reference; tokens
    routed only to the first `used` experts (the others get none)."""
    gen = torch.Generator().manual_seed(seed)
    experts = random_experts(gen, num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, tokens, used, top_k, skew=False)
    args = op_args(x, ids, w, experts)
    scales = {}
    if emulate_w4a4:
        scales = {f"{p}_input_scale": (torch.rand(num_experts, generator=gen) * 0.01 + 1e-3)
                  .to(DEVICE) for p in ("gate", "up", "down")}
    routed = nvfp4_moe_reference(*args, emulate_w4a4=emulate_w4a4, **scales)
    shared = shared_expert(gen, x, routed, hidden, inter)
    ref = nvfp4_moe_reference(*args, emulate_w4a4=emulate_w4a4, **scales, **shared)
    assert_matches_reference(nvfp4_moe(*args, emulate_w4a4=emulate_w4a4, **scales, **shared), ref)
    # the shared expert counts (as much as the routed ones); `alone`: routed weights 0
    assert (ref.float() - routed.float()).abs().amax() > 0.1 * routed.float().abs().amax()
    if alone:
        zero = torch.zeros_like(w)
        assert_matches_reference(nvfp4_moe(x, ids, zero, *args[3:], **shared),
                                 nvfp4_moe_reference(x, ids, zero, *args[3:], **shared))




def dequantized(experts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """`name` ("gate", "up", "down") dequantized to fp32 `[E, N, K]`, global scale included
    (ModelOpt's forms)."""
    codes = experts[f"{name}_weight"]  # uint8 [E, N, K/2]: low nibble first
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:2], -1).long()
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    scale = experts[f"{name}_weight_scale"].float().repeat_interleave(16, dim=-1)
    return e2m1[nibbles] * scale * experts[f"{name}_weight_scale_2"].float().reshape(-1, 1, 1)


def even_odd_rows_to_natural(h: torch.Tensor) -> torch.Tensor:
    """Inverse of the gate/up kernels' `H_EVEN_ODD` store: each 128 columns even, then odd."""
    rows, cols = h.shape
    return h.reshape(rows, cols // 128, 2, 64).transpose(2, 3).reshape(rows, cols)


def gluon_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's plan as on an H200 with `pdl=True` (the Gluon kernels where they apply: stood in
    by the test), its Triton launches without PDL (the interpreter has none)."""
    monkeypatch.setattr(launch, "overlap_pdl", lambda device, pdl: pdl)
    monkeypatch.setattr(launch, "down_gluon_applies",
                        lambda device, variant, block_m: variant == 7 and block_m == 16)
    monkeypatch.setattr(launch, "PDL_LAUNCH", {"PDL": False})


def counters_zero(device: torch.device) -> bool:
    """`moe_overlap`'s counters are all zero (as between launches)."""
    held = moe_overlap._COUNTERS.get(device)
    return held is not None and not bool(held.any())


def against_plain(experts: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                  w: torch.Tensor, shared: dict, bitwise: bool = True) -> torch.Tensor:
    """`nvfp4_moe` on the experts' stored forms (`pdl=True`: where the Gluon kernels apply,
    they run) against `pdl=False` (the Triton kernels alone): bit for bit (`bitwise`), or up to
    summation order; `moe_overlap`'s counters zero afterwards."""
    args = op_args(x, ids, w, stored(experts))
    plain = nvfp4_moe(*args, **shared, pdl=False)
    out = nvfp4_moe(*args, **shared)
    if bitwise:
        assert torch.equal(bits(out), bits(plain))
    else:
        assert_matches_reference(out, plain)
    assert counters_zero(x.device)
    return out
