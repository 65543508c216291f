"""The sm_90 compile checks of `dlmc::nvfp4_moe`'s kernels: every form the op launches, lowered
ahead of time with Triton's bundled ptxas (run by test_kernels_compile_sm90.py's subprocess,
without `TRITON_INTERPRET`).

- The Triton kernels (`_nvfp4_moe_kernels`): v3's and v7's inline-asm decodes, gate/up's
  even-odd h stores, the shared expert's BF16 branch, the counted launches with PDL
  (gate/up releases its slot's count, down acquires it), and DiffusionGemma's GELU experts at
  the canvas's tiles.
- The Gluon down kernel (`_nvfp4_down_gluon`): items by ticket, waiting per routing block or
  per 8-slot part, self-routed, with the shared expert's items.
- The Gluon gate/up kernel (`_nvfp4_gate_up_gluon`): after the alignment, self-routed as the
  op's first launch, with the shared expert's items.
"""

from __future__ import annotations

import inspect

from dlmc.custom_ops import (
    _nvfp4_down_gluon,
    _nvfp4_gate_up_gluon,
    _nvfp4_gluon_parts,
    _nvfp4_shared_items,
)
from dlmc.custom_ops._nvfp4_gate_up_items import x_layout
from dlmc.custom_ops._nvfp4_moe_kernels import _down_kernel, _gate_up_kernel
from dlmc.custom_ops.moe_shared_parts import shared_block_k, shared_split
from dlmc.custom_ops.nvfp4_moe_tiles import default_tiles
from tests.custom_ops.test_kernels_compile_sm90 import compile_sm90, resource_usage

__all__ = ["check_nvfp4_moe", "compile_gluon_sm90"]

_BLOCKS = {"sorted_pair_ptr": "*i32", "expert_of_block_ptr": "*i32", "count_ptr": "*i32"}
GATE_UP = _BLOCKS | {"a_ptr": "*bf16", "gate_w": "*u8", "gate_s": "*u8", "up_w": "*u8",
                     "up_s": "*u8", "gate_alpha_ptr": "*fp32", "up_alpha_ptr": "*fp32",
                     "shared_gate_w": "*bf16", "shared_up_w": "*bf16", "h_ptr": "*bf16"}
DOWN = _BLOCKS | {"h_ptr": "*bf16", "down_w": "*u8", "down_s": "*u8", "down_alpha_ptr": "*fp32",
                  "shared_down_w": "*bf16", "y_ptr": "*bf16"}
LLADA = {"H": 2048, "I": 512, "BLOCK_M": 16, "BLOCK_K": 128, "INTERPRETED": False}


def _types(kernel: object, pointers: dict[str, str]) -> dict[str, str]:
    return {name: pointers.get(name, "i32") for name in kernel.arg_names}


def _divisible(kernel: object, pointers: dict[str, str]) -> tuple[str, ...]:
    """Pointers and strides, as the launcher specializes them at LLaDA2.1-mini shapes."""
    return tuple(n for n in kernel.arg_names if n in pointers or "stride" in n)


def check_decodes() -> None:
    """Kernels v3's and v7's inline asm (the bf16x2 decode; v7 the words' decode and tiled
    loads) assembles for sm_90 in the plain launches; v7's scale codes need no fp32 -> bf16x2
    conversion (only the epilogue's are left; v3 converts each E4M3 scale too). Each also with
    the shared expert's BF16 branch (`SHARED`). Gate/up's `H_EVEN_ODD` (h for the Gluon down
    kernel): the 128-column tile reordered in registers, so its h stores stay 128-bit
    vectors."""
    for kernel, pointers in ((_gate_up_kernel, GATE_UP), (_down_kernel, DOWN)):
        for block_n, has_shared in ((64, False), (128, False), (64, True)):
            conversions = {}
            for variant in (3, 7):
                ptx = compile_sm90(kernel, _types(kernel, pointers), {
                    "H": 256, "I": 128, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128,
                    "INTERPRETED": False, "VARIANT": variant, "SHARED": has_shared,
                    "SHARED_BLOCK_K": 64, "SHARED_SPLIT": 4, "PDL": False}, 4).asm["ptx"]
                assert "griddepcontrol" not in ptx  # (`pdl=False`, or no PDL on the device)
                assert "mul.rn.bf16x2" in ptx
                assert ("shf.r.wrap.b32" in ptx) == (variant == 7)  # the words' decode
                conversions[variant] = ptx.count("cvt.rn.bf16x2.f32")
            assert conversions[7] < conversions[3], conversions  # v7: no scale conversion
    stores = {}
    for even_odd in (False, True):
        ptx = compile_sm90(_gate_up_kernel, _types(_gate_up_kernel, GATE_UP), {
            "H": 256, "I": 128, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128,
            "INTERPRETED": False, "VARIANT": 7, "SHARED": False, "SHARED_BLOCK_K": 64,
            "SHARED_SPLIT": 4, "H_EVEN_ODD": even_odd}, 4,
            _divisible(_gate_up_kernel, GATE_UP)).asm["ptx"]
        stores[even_odd] = (ptx.count("st.global.v4.b32"), ptx.count("st.global.b16"))
    assert stores[True] == stores[False] and stores[True][1] == 0, stores


def check_shared_branch_resources(variant: int) -> None:
    """The shared expert's BF16 branch must not make the FP4 path spill, use more shared memory
    or many more registers (LLaDA2.1-mini shapes, the op's N-tiles; printed for the record)."""
    block_n1 = 64 if variant == 3 else 128
    for kernel, pointers, block_n, k in ((_gate_up_kernel, GATE_UP, block_n1, 2048),
                                         (_down_kernel, DOWN, 128, 512)):
        usage = {}
        for has_shared in (False, True):
            compiled = compile_sm90(kernel, _types(kernel, pointers), LLADA | {
                "BLOCK_N": block_n, "VARIANT": variant, "SHARED": has_shared,
                "SHARED_BLOCK_K": shared_block_k(k), "SHARED_SPLIT": shared_split(block_n)},
                4, _divisible(kernel, pointers), num_stages=3)
            usage[has_shared] = resource_usage(compiled) | {"smem": compiled.metadata.shared}
        print(f"nvfp4_moe v{variant} {kernel.fn.__name__}: FP4 only {usage[False]}, with the "
              f"shared branch {usage[True]}")
        assert usage[True]["LOCAL"] == usage[True]["STACK"] == 0, usage  # no spills
        assert usage[True]["smem"] <= usage[False]["smem"], usage
        assert usage[True]["REG"] <= usage[False]["REG"] + 8, usage


def check_counted_launches() -> None:
    """`moe_overlap`'s counted launches with PDL, as the op launches them (the shared expert's
    parts): v7's gate/up (h even-odd for the Gluon down kernel, or not) and v3's release their
    slot's count; down (all blocks, or v7's shared parts alone next to the Gluon kernel)
    acquires it and no longer waits for the whole grid. The 16-slot forms (a denoising
    block's) without spills, gate/up's with 3 programs of 4 warps per SM."""
    v3 = {"VARIANT": 3, "I": 448}  # (I % 128: v3's shapes)
    for kernel, pointers, consts in (
            (_gate_up_kernel, GATE_UP, {"H_EVEN_ODD": True}),
            (_gate_up_kernel, GATE_UP, {"H_EVEN_ODD": False, "BLOCK_M": 32}),
            (_gate_up_kernel, GATE_UP, v3 | {"BLOCK_N": 64, "SHARED_SPLIT": 4}),
            (_down_kernel, DOWN, {"PARTS_ONLY": True}),
            (_down_kernel, DOWN, {"PARTS_ONLY": False, "BLOCK_M": 32}),
            (_down_kernel, DOWN, v3 | {"GATE_UP_TILES": 7})):
        consts = LLADA | {"BLOCK_N": 128, "VARIANT": 7, "SHARED": True, "SHARED_BLOCK_K": 128,
                          "SHARED_SPLIT": 4, "OVERLAP": True, "PDL": True} | consts
        if kernel is _down_kernel:
            consts = {"GATE_UP_TILES": 4, "GATE_UP_SPLIT": 4} | consts
        compiled = compile_sm90(kernel, _types(kernel, pointers), consts, 4,
                                _divisible(kernel, pointers), num_stages=3)
        usage = resource_usage(compiled)
        print(f"nvfp4_moe v{consts['VARIANT']} {kernel.fn.__name__} counted, BLOCK_M "
              f"{consts['BLOCK_M']}: {usage}")
        ptx = compiled.asm["ptx"]
        release, acquire = ".gpu.release." in ptx, ".gpu.acquire." in ptx
        assert (release, acquire) == ((True, False) if kernel is _gate_up_kernel
                                      else (False, True)), (release, acquire)
        if consts["BLOCK_M"] == 16:
            assert usage["LOCAL"] == usage["STACK"] == 0, usage
        if consts["BLOCK_M"] == 16 and kernel is _gate_up_kernel:
            assert 65536 // (128 * -(-usage["REG"] // 8) * 8) >= 3, usage


def check_diffusiongemma_forms() -> None:
    """DiffusionGemma's experts (H 2816, I 704: kernel v3) at the canvas's tiles
    (`default_tiles`: 32-slot blocks, gate/up N-tiles of 64, K-steps of 128), counted with PDL
    as the op launches them on sm_90, and plain: gate/up with GELU (libdevice's `tanhf`:
    `sqrt(2/pi)` in the PTX, `ex2`/`rcp` approximations as CUDA's `tanhf`) or SiLU, down.
    No spills (registers printed for the record)."""
    tiles = default_tiles(256, 8, 128, 2816, 704, 3)
    diffusiongemma = {"H": 2816, "I": 704, "BLOCK_M": tiles.block_m, "BLOCK_K": 128,
                      "INTERPRETED": False, "VARIANT": 3, "SHARED": False, "SHARED_BLOCK_K": 128,
                      "SHARED_SPLIT": 4}
    forms = [(_gate_up_kernel, GATE_UP, {"BLOCK_N": tiles.gate_up_block_n, "ACTIVATION": act,
                                         "OVERLAP": overlap, "PDL": overlap})
             for act in ("gelu_tanh", "silu") for overlap in (True, False)]
    forms += [(_down_kernel, DOWN, {"BLOCK_N": tiles.down_block_n, "OVERLAP": overlap,
                                    "PDL": overlap, "GATE_UP_TILES": 11, "GATE_UP_SPLIT": 4})
              for overlap in (True, False)]
    for kernel, pointers, consts in forms:
        compiled = compile_sm90(kernel, _types(kernel, pointers), diffusiongemma | consts,
                                tiles.gate_up_warps if kernel is _gate_up_kernel else
                                tiles.down_warps, _divisible(kernel, pointers),
                                num_stages=tiles.num_stages)
        usage = resource_usage(compiled)
        form = {k: v for k, v in consts.items() if k in ("ACTIVATION", "OVERLAP")}
        print(f"nvfp4_moe DiffusionGemma {kernel.fn.__name__} {form}: {usage}")
        assert usage["LOCAL"] == 0, (form, usage)
        ptx = compiled.asm["ptx"]
        gelu = consts.get("ACTIVATION") == "gelu_tanh"
        assert ("0f3F4C422A" in ptx) == gelu, form  # sqrt(2/pi) in fp32
        assert ("rcp.approx" in ptx and "ex2.approx" in ptx) or not gelu, form


def compile_gluon_sm90(kernel: object, types: dict[str, str], consts: dict[str, object],
                       maxnreg: int) -> tuple[object, dict[str, int]]:
    """`kernel` lowered for sm_90 with 4 warps and `maxnreg` registers (arguments not in `types`
    are i32, `consts` are constexprs; constexprs left out, and arguments that default to None,
    take their defaults): the compiled kernel and its resource usage."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {p.name: p.default for p in kernel.params
              if p.name not in types and (p.is_constexpr or p.default is None)
              and p.default is not inspect.Parameter.empty} | consts
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature |= dict.fromkeys(consts, "constexpr")
    compiled = triton_compile(GluonASTSource(kernel, signature, consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": maxnreg})
    return compiled, resource_usage(compiled)


def _descriptor_types() -> dict[str, str]:
    """The Gluon kernels' TMA descriptors: v7 words and codes, h boxes, x rows, the shared
    items' bf16 boxes."""
    w, s, h = _nvfp4_gluon_parts.shared_layouts()
    rows64, rows128 = _nvfp4_shared_items.ROWS_64.value, _nvfp4_shared_items.ROWS_128.value
    box = f"tensordesc<bf16[32, 64],{rows128!r}>"
    return {"words": f"tensordesc<u8[64, 128],{w!r}>", "codes": f"tensordesc<i32[8, 32],{s!r}>",
            "h": f"tensordesc<bf16[8, 64],{h!r}>", "x": f"tensordesc<bf16[1, 128],{x_layout()!r}>",
            "down_tile": f"tensordesc<bf16[128, 32],{rows64!r}>",
            "h_tile": f"tensordesc<bf16[16, 32],{rows64!r}>", "box": box}


def check_gluon_down() -> None:
    """Each launch form of the Gluon down kernel lowers for sm_90 within `MAXNREG` registers
    and without spills: with PDL (one wait, at its end) and items by ticket (the producer spins
    for the rows, fences and copies them: `fence.proxy.async.global`; relaxed adds: the first
    ticket, one ahead per item, the reader count; exchanges: the last reader's two counter
    resets and the ticket reset), waiting per routing block or per 8-slot part (`PER_PART`,
    the Gluon gate/up's counts), and `SELF` (`_nvfp4_down_self_route`: the items routed from
    the ids, no alignment read: the kernel's only global loads are the ids, the alphas and the
    counters), also with a shared expert's y row after every 8 pairs (`PAIR_GAP`) and its
    items (`_nvfp4_shared_items`: per K-step a down tile and an h box, 16 unrolled steps)."""
    d = _descriptor_types()
    types = {"w_d": d["words"], "s_d": d["codes"], "h_d": d["h"], "expert_of_block_ptr": "*i32",
             "sorted_pair_ptr": "*i32", "alpha_ptr": "*fp32", "y_ptr": "*bf16",
             "count_ptr": "*i32", "ids_ptr": "*i64", "sd_d": d["down_tile"],
             "hs_d": d["h_tile"]}
    base = {"STAGES": _nvfp4_down_gluon.STAGES, "KSTEPS": 4, "TILES": 16, "I": 512, "H": 2048,
            "BLOCK_M": 16}
    routed = {"SELF": True, "PAIRS_PAD": 256, "EXPERTS_PAD": 256}
    for per_part, self_routed, items in ((False, False, 0), (True, False, 0), (True, True, 0),
                                         (True, True, 32)):
        consts = base | {"PER_PART": per_part} | (routed if self_routed else {})
        if items:
            consts |= {"PAIR_GAP": 8, "SHARED_ITEMS": items}
        compiled, usage = compile_gluon_sm90(_nvfp4_down_gluon._down_gluon_kernel, types,
                                             consts, _nvfp4_down_gluon.MAXNREG)
        form = (per_part, self_routed, items)
        print(f"nvfp4_moe Gluon down (per part, self-routed, shared items) {form}: {usage}")
        assert usage["REG"] <= _nvfp4_down_gluon.MAXNREG, (form, usage)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (form, usage)
        ptx = compiled.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") == 1, form
        assert "griddepcontrol.launch_dependents" in ptx, form
        # (the shared items: one more reader count and its two resets)
        assert ptx.count("relaxed.add") == 3 + bool(items), (form, ptx.count("relaxed.add"))
        assert ptx.count("relaxed.exch") == 3 + 2 * bool(items), (form,
                                                                  ptx.count("relaxed.exch"))
        assert "fence.proxy.async.global" in ptx, form
        assert ".reqntid 256" in ptx  # 3 programs per SM at 80 registers: 61440 of 65536
        if self_routed and not items:  # the ids (16 B vectors of 4 lanes' ids), the alphas
            assert ptx.count("ld.global") <= 6, (form, ptx.count("ld.global"))
        if items:
            assert ptx.count("cp.async.bulk.tensor") == 16 + 2 * 16, form


def check_gluon_gate_up() -> None:
    """Each launch form of the Gluon gate/up kernel lowers for sm_90 with at most `MAXNREG`
    registers, no spills, at most the ring plus 1 KB of shared memory (what `programs_per_sm`
    assumes), 256 threads (`THREADS`), its TMA copies (gate, up, their codes and 8 x rows per
    K-step) and release counts, and the PDL instructions of each form: after the alignment (a
    wait, then the next launch let go), or self-routed as the op's first launch (6 items per
    program of the LLaDA2.1-mini routing, tables padded to 8 rows: a wait before the routing
    reads the ids, and the producer's wait after its first item's copies, or at once without
    one), also with the shared expert's items (three more copies per K-step: gate, up, x)."""
    module = _nvfp4_gate_up_gluon
    d = _descriptor_types()
    types = {"g_d": d["words"], "gs_d": d["codes"], "u_d": d["words"], "us_d": d["codes"],
             "x_d": d["x"], "expert_of_block_ptr": "*i32", "sorted_pair_ptr": "*i32",
             "gate_alpha_ptr": "*fp32", "up_alpha_ptr": "*fp32", "h_ptr": "*bf16",
             "count_ptr": "*i32", "ids_ptr": "*i64", "sg_d": d["box"], "su_d": d["box"],
             "xs_d": d["box"]}
    base = {"STAGES": module.STAGES, "H": 2048, "I": 512, "BLOCK_M": 16}
    routed = {"SELF": True, "G": 6, "PAIRS_PAD": 256, "EXPERTS_PAD": 256}
    for block_m, self_routed, items in ((16, False, False), (32, False, False),
                                        (16, True, False), (16, True, True)):
        consts = base | {"BLOCK_M": block_m, "PDL_ENTER": not self_routed}
        consts |= (routed | {"SHARED_ITEMS": items}) if self_routed else {}
        compiled, usage = compile_gluon_sm90(module._gate_up_gluon_kernel, types, consts,
                                             module.MAXNREG)
        form = (block_m, self_routed, items)
        print(f"nvfp4_moe Gluon gate/up (block_m, self-routed, shared items) {form}: {usage}, "
              f"smem {compiled.metadata.shared}")
        assert usage["REG"] <= module.MAXNREG and usage["LOCAL"] == 0, (form, usage)
        assert usage["STACK"] == 0, (form, usage)
        assert compiled.metadata.shared <= module.STAGES * module.STAGE_BYTES + 1024, form
        assert 32 * compiled.metadata.num_warps == module.THREADS, form
        ptx = compiled.asm["ptx"]
        assert ".reqntid 256" in ptx, form
        assert ptx.count("griddepcontrol.wait") == (3 if self_routed else 1), form
        assert ptx.count("griddepcontrol.launch_dependents") == (3 if self_routed else 1), form
        if self_routed:  # the wait comes before the routing's loads of the ids
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), form
        assert ptx.count("cp.async.bulk.tensor") == 4 + 8 + 3 * items, form
        assert ptx.count("atom.global.gpu.release.add") == 1 + items, form  # the counts


def check_nvfp4_moe() -> None:
    check_decodes()
    for variant in (3, 7):
        check_shared_branch_resources(variant)
    check_counted_launches()
    check_diffusiongemma_forms()
    check_gluon_down()
    check_gluon_gate_up()
