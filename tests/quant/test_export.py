"""NVFP4 export of a tiny synthetic BF16 checkpoint, read back and validated; tensor validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dlmc.errors import CheckpointError
from dlmc.models.nvfp4_experts import NVFP4Experts
from dlmc.quant.export import export_nvfp4, kv_scale_names
from dlmc.quant.modelopt_config import load_quant_config
from dlmc.quant.nvfp4_format import dequantize_nvfp4, quantize_nvfp4
from dlmc.quant.validate import (
    TensorMeta,
    safetensors_meta,
    validate_kv_scale,
    validate_nvfp4_linear,
)

H, I, E = 32, 16, 3


def tiny_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Layer 0 dense, layer 1 MoE with E experts; two shards plus an index."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    first = {"model.word_embeddings.weight": rand(64, H),
             "model.layers.0.attention.query_key_value.weight": rand(3 * H, H),
             "model.layers.0.mlp.gate_proj.weight": rand(4 * H, H),
             "model.layers.0.mlp.down_proj.weight": rand(H, 4 * H)}
    second = {"model.layers.1.attention.query_key_value.weight": rand(3 * H, H),
              "model.layers.1.mlp.gate.weight": rand(E, H),
              "model.layers.1.mlp.shared_experts.up_proj.weight": rand(I, H),
              "model.norm.weight": rand(H), "lm_head.weight": rand(64, H)}
    for e in range(E):
        prefix = f"model.layers.1.mlp.experts.{e}"
        second[f"{prefix}.gate_proj.weight"] = rand(I, H)
        second[f"{prefix}.up_proj.weight"] = rand(I, H)
        second[f"{prefix}.down_proj.weight"] = rand(H, I)
    save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    save_file(second, str(directory / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llada2_moe"}))
    for name in ("tokenizer.json", "generation_config.json", "paper_decoding.json"):
        (directory / name).write_text("{}")
    return first | second


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in directory.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return tensors


def test_export_round_trip(tmp_path: Path) -> None:
    source, output = tmp_path / "bf16", tmp_path / "nvfp4"
    source.mkdir()
    originals = tiny_checkpoint(source)
    export_nvfp4(source, output, input_amax=3.0, kv_scales={0: (0.5, 0.25), 1: (1.0, 2.0)})
    for name in ("tokenizer.json", "generation_config.json", "paper_decoding.json"):
        assert (output / name).is_file()
    config = load_quant_config(output)
    assert config is not None and config.kv_cache_fp8
    assert json.loads((output / "config.json").read_text())["quantization_config"]["ignore"] == (
        list(config.exclude_modules))
    tensors = read_all(output)
    index = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors)
    experts = NVFP4Experts(E, H, I)
    for name, original in originals.items():
        module = name.removesuffix(".weight")
        if ".experts." not in name:
            assert torch.equal(tensors[name], original), name
            assert not config.is_quantized(module) or original.dim() == 1, module
            continue
        assert config.is_quantized(module), module
        out_f, in_f = original.shape
        with safe_open(str(output / index[name]), framework="pt") as handle:
            metas = {s: safetensors_meta(handle, f"{module}.{s}")
                     for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
        validate_nvfp4_linear(module, metas, out_f, in_f, require_input_scale=True)
        parts = {s: tensors[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2")}
        validate_nvfp4_linear(module, parts, out_f, in_f)
        expected = dequantize_nvfp4(*quantize_nvfp4(original))
        assert torch.equal(dequantize_nvfp4(*parts.values()), expected)
        assert tensors[f"{module}.input_scale"].item() == pytest.approx(3.0 / 2688)
        expert, proj = int(module.split(".")[-2]), module.split(".")[-1]
        for suffix, value in parts.items():
            getattr(experts, f"{proj}_{suffix}")[expert] = value  # what the loader does
    bf16 = experts.dequantize_to_bf16()
    for e in range(E):
        original = originals[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(bf16["down_proj"][e], dequantize_nvfp4(*quantize_nvfp4(original)))
    for layer, values in ((0, (0.5, 0.25)), (1, (1.0, 2.0))):
        for name, value in zip(kv_scale_names(layer), values, strict=True):
            validate_kv_scale(name, tensors[name])
            assert tensors[name].item() == value


def test_export_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        export_nvfp4(tmp_path, tmp_path / "out")
    tiny_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="kv_scales: no attention tensors found for layers"):
        export_nvfp4(tmp_path, tmp_path / "out", kv_scales={7: (1.0, 1.0)})


def test_export_diffusion_gemma_splits_the_stacked_experts(tmp_path: Path) -> None:
    """`diffusion_gemma`: each expert of the stacked BF16 `gate_up_proj` / `down_proj` becomes
    ModelOpt's per-expert NVFP4 linears (gate and up sharing the global scale of their fused
    amax), the stacks are kept unchanged beside them, KV scales sit on `self_attn`."""
    from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint
    from dlmc.quant.nvfp4_format import global_scale_from_amax

    source = write_tiny_gemma_checkpoint(tmp_path / "bf16", seed=1, shards=2, tokenizer=False,
                                         moe_intermediate_size=32)
    output = export_nvfp4(source, tmp_path / "nvfp4", input_amax=6.0,
                          kv_scales={layer: (0.5, 0.25) for layer in range(6)})
    originals, tensors = read_all(source), read_all(output)
    config = load_quant_config(output)
    assert config is not None and config.kv_cache_fp8
    assert set(originals) <= set(tensors)  # the BF16 stacks too
    assert all(torch.equal(tensors[n], t) for n, t in originals.items())
    for layer in (0, 5):
        prefix = f"model.decoder.layers.{layer}.experts"
        gate_up, down = originals[f"{prefix}.gate_up_proj"], originals[f"{prefix}.down_proj"]
        for e in range(8):
            shared = global_scale_from_amax(gate_up[e].float().abs().amax())
            for proj, weight, scale in (("gate_proj", gate_up[e, :32], shared),
                                        ("up_proj", gate_up[e, 32:], shared),
                                        ("down_proj", down[e], None)):
                module = f"{prefix}.{e}.{proj}"
                assert config.is_quantized(module), module
                parts = [tensors[f"{module}.{s}"] for s in ("weight", "weight_scale",
                                                            "weight_scale_2")]
                validate_nvfp4_linear(module, dict(zip(("weight", "weight_scale",
                                                        "weight_scale_2"), parts, strict=True)),
                                      *weight.shape)
                for got, want in zip(parts, quantize_nvfp4(weight, scale), strict=True):
                    assert got.dtype == want.dtype and torch.equal(got, want), module
                assert tensors[f"{module}.input_scale"].item() == pytest.approx(6.0 / 2688)
        for name, value in zip(kv_scale_names(layer, "diffusion_gemma"), (0.5, 0.25),
                               strict=True):
            assert name.startswith(f"model.decoder.layers.{layer}.self_attn.")
            assert tensors[name].item() == value
    for module in ("model.decoder.layers.2.self_attn.q_proj",
                   "model.decoder.layers.4.router.proj", "model.decoder.self_conditioning.up_proj",
                   "model.decoder.layers.1.mlp.down_proj"):
        assert not config.is_quantized(module), module


def test_export_diffusion_gemma_errors(tmp_path: Path) -> None:
    from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint

    source = write_tiny_gemma_checkpoint(tmp_path / "bf16", shards=1, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"model.decoder.layers.0.experts.down_proj holds "
                       r"a weight of shape \(64, 24\) for .*layers.0.experts.0.down_proj"):
        export_nvfp4(source, tmp_path / "out")  # 24-wide experts: not a multiple of 16
    (source / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(CheckpointError, match="model_type 'gemma4': the exporter writes"):
        export_nvfp4(source, tmp_path / "out")


GOOD = {"weight": TensorMeta(torch.uint8, (32, 32)),
        "weight_scale": TensorMeta(torch.float8_e4m3fn, (32, 4)),
        "weight_scale_2": TensorMeta(torch.float32, ()),
        "input_scale": TensorMeta(torch.float32, (1,))}


@pytest.mark.parametrize(("change", "message"), [
    ({"weight_scale": None}, r"m.weight_scale: missing"),
    ({"weight_scale_2": None}, r"m.weight_scale_2: missing"),
    ({"weight": TensorMeta(torch.bfloat16, (32, 64))}, r"m.weight: is an unquantized"),
    ({"weight": TensorMeta(torch.uint8, (32, 64))}, r"m.weight: expected packed E2M1 .*\(32, 32\)"),
    ({"weight_scale": TensorMeta(torch.float8_e4m3fn, (128, 4))}, r"m.weight_scale: .*swizzled"),
    ({"weight_scale": TensorMeta(torch.float8_e4m3fn, (512,))}, r"m.weight_scale: .*swizzled"),
    ({"weight_scale": TensorMeta(torch.uint8, (32, 4))}, r"m.weight_scale: expected .* dtype"),
    ({"weight_scale": TensorMeta(torch.float8_e4m3fn, (32, 2))}, r"m.weight_scale: expected"),
    ({"weight_scale_2": TensorMeta(torch.float32, (2,))}, r"m.weight_scale_2: expected fp32"),
    ({"input_scale": TensorMeta(torch.bfloat16, ())}, r"m.input_scale: expected fp32"),
    ({"weight_scale_2": torch.tensor(float("nan"))}, r"m.weight_scale_2: expected a finite"),
    ({"input_scale": torch.tensor(0.0)}, r"m.input_scale: expected a finite positive"),
])
def test_validate_errors(change: dict, message: str) -> None:
    tensors = {k: v for k, v in (GOOD | change).items() if v is not None}
    with pytest.raises(CheckpointError, match=message):
        validate_nvfp4_linear("m", tensors, 32, 64)


def test_validate_in_features_and_input_scale() -> None:
    validate_nvfp4_linear("m", GOOD, 32, 64, require_input_scale=True)
    with pytest.raises(CheckpointError, match="not a multiple of 16"):
        validate_nvfp4_linear("m", GOOD, 32, 40)
    without = {k: v for k, v in GOOD.items() if k != "input_scale"}
    with pytest.raises(CheckpointError, match="m.input_scale: missing"):
        validate_nvfp4_linear("m", without, 32, 64, require_input_scale=True)
    with pytest.raises(CheckpointError, match="k_scale: expected FP8 KV-cache scale"):
        validate_kv_scale("k_scale", TensorMeta(torch.bfloat16, ()))
