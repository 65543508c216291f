"""A tiny DiffusionGemma NVFP4 export in the ModelOpt format (per-expert NVFP4 tensors, the BF16
expert copies beside them, FP8 KV scales) loads without reading the copies; packed and
dequantized it is the same model; every malformed case is an error naming the tensor or the
config field."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmc.errors import CheckpointError
from dlmc.loading.gemma_nvfp4 import is_bf16_expert_copy
from dlmc.loading.loader import load_model
from dlmc.loading.safetensors_index import SafetensorsIndex
from dlmc.loading.tiny_gemma import TINY_NVFP4_INPUT_AMAX, write_tiny_gemma_nvfp4
from dlmc.models.diffusion_gemma_attention import CanvasContext, CausalContext, GemmaKVCache
from dlmc.models.diffusion_gemma_moe import GemmaExperts
from dlmc.models.nvfp4_experts import NVFP4Experts
from dlmc.quant.nvfp4_format import dequantize_nvfp4

CPU = torch.device("cpu")
LAYERS, EXPERTS, HIDDEN, INTER = 6, 8, 64, 32
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return write_tiny_gemma_nvfp4(tmp_path_factory.mktemp("gemma-nvfp4") / "g", seed=3,
                                  shards=1, tokenizer=False)


@pytest.fixture()
def broken(tmp_path, export):
    """A copy of the export for a test to damage."""
    return shutil.copytree(export, tmp_path / "broken")


def _edit(directory, fn):
    file = directory / "model.safetensors"
    sd = load_file(str(file))
    fn(sd)
    save_file(sd, str(file))


def _edit_quant(directory, fn):
    raw = json.loads((directory / "hf_quant_config.json").read_text())
    fn(raw["quantization"])
    (directory / "hf_quant_config.json").write_text(json.dumps(raw))


def _passes(model, forced=None, seed=0, prompt_len=20, canvas_len=32):
    """Encoder logits of a prompt and decoder logits of a canvas after it, with every layer's
    (input, output); with `forced`, each layer runs on the input recorded there instead of its
    own (the same K/V and routing on both sides, so only the experts' numerics differ)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 300, (prompt_len,), generator=gen).to(device)
    canvas = torch.randint(0, 300, (canvas_len,), generator=gen).to(device)
    positions = torch.arange(prompt_len + canvas_len, device=device)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def pre(module, args):
        return None if forced is None else (forced[len(seen)][0], *args[1:])

    def post(module, args, out):
        seen.append((args[0], out))

    hooks = [h for layer in model.model.decoder.layers for h in (
        layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))]
    cache = GemmaKVCache(LAYERS)
    with torch.no_grad():
        enc = model(prompt, positions[:prompt_len], CausalContext(cache))
        dec = model(canvas, positions[prompt_len:], CanvasContext(cache), decoder=True)
    for hook in hooks:
        hook.remove()
    return (enc, dec), seen


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_export_keeps_the_bf16_copies_beside_the_nvfp4_experts(export):
    index = SafetensorsIndex(export)
    copies = sorted(n for n in index.tensors if is_bf16_expert_copy(n))
    assert len(copies) == 2 * LAYERS
    info = index.tensors["model.decoder.layers.2.experts.gate_up_proj"]
    assert (info.dtype, info.shape) == ("BF16", (EXPERTS, 2 * INTER, HIDDEN))
    info = index.tensors["model.decoder.layers.2.experts.7.down_proj.weight"]
    assert (info.dtype, info.shape) == ("U8", (HIDDEN, INTER // 2))


@pytest.mark.parametrize("precision", ["nvfp4", "bf16", "auto"])
def test_loads_without_reading_the_bf16_copies(export, precision, monkeypatch):
    read: list[str] = []
    real_get = SafetensorsIndex.get

    def spy(self, name):
        if is_bf16_expert_copy(name):  # the reader refuses them: loading must not ask
            raise AssertionError(f"read {name}")
        read.append(name)
        return real_get(self, name)

    monkeypatch.setattr(SafetensorsIndex, "get", spy)
    loaded = load_model(export, CPU, torch.float32, precision=precision)
    assert loaded.quantized_checkpoint and loaded.declares_fp8_kv
    assert loaded.precision == ("nvfp4" if precision == "nvfp4" else "bf16")  # auto: CPU
    index = SafetensorsIndex(export)
    expert_tensors = {f"model.decoder.layers.{layer}.experts.{e}.{proj}.{s}"
                      for layer in range(LAYERS) for e in range(EXPERTS)
                      for proj in ("gate_proj", "up_proj", "down_proj") for s in SUFFIXES}
    assert expert_tensors <= set(read) and len(read) == len(set(read))
    assert not any(".vision_tower." in n for n in read)
    experts = [layer.experts for layer in loaded.model.model.decoder.layers]
    kind = NVFP4Experts if precision == "nvfp4" else GemmaExperts
    assert all(type(e) is kind for e in experts)
    assert loaded.kv_scales.k == pytest.approx((0.01,) * LAYERS)
    assert loaded.kv_scales.v == pytest.approx((0.01,) * LAYERS)
    assert len([n for n in index.tensors if n.endswith(("k_scale", "v_scale"))]) == 2 * LAYERS


def test_packed_and_dequantized_experts_are_the_checkpoint_tensors(export):
    """precision "nvfp4" stacks the tensors bit for bit; "bf16" holds each weight dequantized
    exactly (fp32 product rounded once to bf16) in GemmaExperts' fused layout."""
    sd = load_file(str(export / "model.safetensors"))
    packed = load_model(export, CPU, torch.bfloat16, precision="nvfp4").model
    dense = load_model(export, CPU, torch.bfloat16, precision="bf16").model
    for layer in (0, 5):
        nv, bf = (m.model.decoder.layers[layer].experts for m in (packed, dense))
        assert nv.activation == "gelu_tanh" and nv.use_reference
        for e in range(EXPERTS):
            deq = {}
            for proj in ("gate_proj", "up_proj", "down_proj"):
                src = {s: sd[f"model.decoder.layers.{layer}.experts.{e}.{proj}.{s}"]
                       for s in SUFFIXES}
                for s in SUFFIXES:
                    assert torch.equal(getattr(nv, f"{proj}_{s}")[e], src[s].reshape(
                        getattr(nv, f"{proj}_{s}")[e].shape)), (layer, e, proj, s)
                deq[proj] = dequantize_nvfp4(src["weight"], src["weight_scale"],
                                             src["weight_scale_2"])
            assert float(src["input_scale"]) == pytest.approx(TINY_NVFP4_INPUT_AMAX / 2688)
            assert torch.equal(bf.gate_up_proj[e], torch.cat([deq["gate_proj"], deq["up_proj"]]))
            assert torch.equal(bf.down_proj[e], deq["down_proj"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_logits_equal_the_dequantized_models(export, dtype):
    """Encoder and decoder passes: the packed experts (the op's reference) against
    `GemmaExperts` over the dequantized weights, each layer fed the same input (the tiny random
    model amplifies any rounding in a free run: bf16-rounding the experts' outputs alone moves
    its logits by several percent). They differ only by the op's bf16 rounding of the experts'
    intermediates and the dequantized weights' rounding to bf16."""
    packed = load_model(export, CPU, dtype, precision="nvfp4").model
    dense = load_model(export, CPU, dtype, precision="bf16").model
    tol = 2e-3 if dtype == torch.float32 else 8e-3
    for seed in range(2):
        want, layers_want = _passes(dense, seed=seed)
        got, layers_got = _passes(packed, forced=layers_want, seed=seed)
        assert len(layers_got) == len(layers_want) == 2 * LAYERS
        for (_, out_got), (_, out_want) in zip(layers_got, layers_want, strict=True):
            assert 0 < _rel(out_got, out_want) < 2.5 * tol
        for g, w in zip(got, want, strict=True):  # encoder, decoder
            assert 0 < _rel(g, w) < tol
            agree = (g.argmax(-1) == w.argmax(-1)).float().mean()
            assert agree == 1.0 if dtype == torch.float32 else agree >= 0.95


def _to_fused_gate_up(sd):
    """Each expert's gate_proj/up_proj tensors -> one `gate_up_proj` (gate rows first; the
    exporter gives gate and up one global scale)."""
    for name in [n for n in sd if ".gate_proj.weight_scale_2" in n and ".experts." in n]:
        base = name.removesuffix(".gate_proj.weight_scale_2")
        gate = {s: sd.pop(f"{base}.gate_proj.{s}") for s in SUFFIXES}
        up = {s: sd.pop(f"{base}.up_proj.{s}") for s in SUFFIXES}
        assert torch.equal(gate["weight_scale_2"], up["weight_scale_2"])
        for s in ("weight", "weight_scale"):
            sd[f"{base}.gate_up_proj.{s}"] = torch.cat([gate[s], up[s]])
        for s in ("weight_scale_2", "input_scale"):
            sd[f"{base}.gate_up_proj.{s}"] = gate[s]


@pytest.mark.parametrize("rename", ["fused_gate_up", "encoder_prefix"])
def test_other_expert_layouts_load_the_same_model(broken, export, rename):
    """A fused per-expert `gate_up_proj` NVFP4 linear, or the experts under the tied encoder's
    name (`model.encoder.language_model.layers.L.experts.E.*`): the same buffers and logits."""
    if rename == "fused_gate_up":
        _edit(broken, _to_fused_gate_up)
    else:
        _edit(broken, lambda sd: sd.update({
            n.replace("model.decoder.", "model.encoder.language_model."): sd.pop(n)
            for n in [n for n in sd if ".experts." in n and not is_bf16_expert_copy(n)]}))
    for precision in ("nvfp4", "bf16"):
        want = load_model(export, CPU, torch.float32, precision=precision).model
        got = load_model(broken, CPU, torch.float32, precision=precision).model
        assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(),
                                                     want.state_dict().values(), strict=True))
        (enc, dec), _ = _passes(got)
        (want_enc, want_dec), _ = _passes(want)
        assert torch.equal(enc, want_enc) and torch.equal(dec, want_dec)


def test_quant_config_from_config_json_when_hf_quant_config_is_absent(broken):
    (broken / "hf_quant_config.json").unlink()
    loaded = load_model(broken, CPU, torch.float32, precision="nvfp4")
    assert loaded.precision == "nvfp4" and loaded.declares_fp8_kv


def test_builtin_decodes_with_packed_experts(tmp_path, monkeypatch):
    from dlmc import LLM
    from dlmc.loading.tiny_gemma_tokenizer import BOS_ID

    monkeypatch.setenv("DLMC_CACHE", str(tmp_path / "cache"))
    llm = LLM("tiny-diffusiongemma-nvfp4", device="cpu", precision="nvfp4")
    assert llm.model_dir.name.startswith("tiny-diffusiongemma-nvfp4") and llm.precision == "nvfp4"
    assert llm.config.moe_intermediate_size == INTER
    assert type(llm.model.model.decoder.layers[0].experts) is NVFP4Experts
    res = llm.generate(prompt_token_ids=[BOS_ID, 300], seed=0, max_new_tokens=32,
                       max_denoising_steps=3)
    assert res.blocks == 1 and 0 < res.num_forwards <= 3 and res.token_ids
    assert LLM("tiny-diffusiongemma-nvfp4", device="cpu").precision == "bf16"  # auto on CPU


E3 = "model.decoder.layers.1.experts.3"
COPY = r"; the BF16 copy model\.decoder\.layers\.1\.experts\.gate_up_proj is never read"


def _drop_expert(sd, base):
    for name in [n for n in sd if n.startswith(base + ".")]:
        sd.pop(name)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop(f"{E3}.up_proj.weight_scale"),  # incomplete, beside its BF16 copy
     rf"{E3}\.up_proj\.weight_scale: missing \(the quantization config marks {E3}\.up_proj as "
     rf"NVFP4\){COPY}"),
    (lambda sd: [sd.pop(f"{E3}.down_proj.weight_scale_2"),
                 sd.pop("model.decoder.layers.1.experts.down_proj")],  # no BF16 copy
     rf"{E3}\.down_proj\.weight_scale_2: missing \(the quantization config marks "
     rf"{E3}\.down_proj as NVFP4\)$"),
    (lambda sd: _drop_expert(sd, "model.decoder.layers.4.experts.7"),  # quantized but absent
     r"model\.decoder\.layers\.4\.experts\.7\.gate_proj\.weight: missing \(the quantization "
     r"config marks .* as NVFP4\); the BF16 copy .*layers\.4\.experts\.gate_up_proj"),
    (lambda sd: sd.__setitem__(f"{E3}.gate_proj.weight_scale",
                               torch.zeros(INTER, HIDDEN // 16, dtype=torch.uint8)),
     rf"{E3}\.gate_proj\.weight_scale: expected per-16 FP8 block scales of dtype "
     r"torch\.float8_e4m3fn, got torch\.uint8"),
    (lambda sd: sd.__setitem__(f"{E3}.up_proj.weight_scale_2", torch.ones(1).bfloat16()),
     rf"{E3}\.up_proj\.weight_scale_2: expected fp32 scalar of dtype torch\.float32"),
    (lambda sd: sd.__setitem__(f"{E3}.down_proj.weight",
                               torch.zeros(HIDDEN, INTER // 4, dtype=torch.uint8)),
     rf"{E3}\.down_proj\.weight: expected packed E2M1 codes of shape \(64, 16\), got \(64, 8\)"),
    (lambda sd: sd.__setitem__(f"{E3}.gate_proj.weight",
                               torch.zeros(INTER, HIDDEN, dtype=torch.bfloat16)),
     rf"{E3}\.gate_proj\.weight: is an unquantized torch\.bfloat16 tensor"),
    (lambda sd: sd.__setitem__(f"{E3}.gate_up_proj.weight",
                               torch.zeros(2 * INTER, HIDDEN // 2, dtype=torch.uint8)),
     rf"expert {E3} has both a fused {E3}\.gate_up_proj\.\* and split {E3}\.gate_proj\.\*"),
    (lambda sd: sd.__setitem__(f"{E3}.up_proj.weight_scale_2", torch.tensor(0.0)),
     rf"{E3}\.up_proj\.weight_scale_2: expected a finite positive scale, got 0\.0"),
    (lambda sd: sd.__setitem__("model.decoder.layers.0.self_attn.q_proj.weight",
                               torch.zeros(64, 32, dtype=torch.uint8)),
     r"model\.safetensors: model\.decoder\.layers\.0\.self_attn\.q_proj\.weight is quantized, "
     r"but dlmc runs NVFP4 only for DiffusionGemma's routed experts"),
    (lambda sd: sd.__setitem__("model.decoder.layers.2.self_attn.v_scale", torch.tensor(-1.0)),
     r"KV scale model\.decoder\.layers\.2\.self_attn\.v_scale .* is -1\.0; expected a positive"),
])
def test_malformed_exports_are_named(broken, edit, message):
    _edit(broken, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken, CPU, torch.float32, precision="nvfp4")


def _mixed_without(base):
    def edit(quant):
        quant.update(quant_algo="MIXED_PRECISION", quantized_layers={
            f"model.decoder.layers.{layer}.experts.{e}.{proj}": {"quant_algo": "NVFP4",
                                                                 "group_size": 16}
            for layer in range(LAYERS) for e in range(EXPERTS)
            for proj in ("gate_proj", "up_proj", "down_proj")})
        quant["quantized_layers"].pop(base)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (lambda q: q.update(quant_algo="W4A8_AWQ"), r"`quant_algo` 'W4A8_AWQ' is not supported"),
    (lambda q: q.update(group_size=32), r"`group_size` must be 16 for NVFP4, got 32"),
    (lambda q: q.update(kv_cache_quant_algo="INT8"), r"`kv_cache_quant_algo` 'INT8'"),
    (lambda q: q.pop("quant_algo"), r"hf_quant_config\.json \(quantization\): missing field "
                                    r"`quant_algo`"),
    (lambda q: q["exclude_modules"].append("model.decoder.layers.*.experts.*"),
     r"hf_quant_config\.json \(quantization\): model\.decoder\.layers\.0\.experts\.0\.gate_proj "
     r"is matched by `exclude_modules`"),
    (_mixed_without("model.decoder.layers.3.experts.5.down_proj"),
     r"model\.decoder\.layers\.3\.experts\.5\.down_proj is not listed in `quantized_layers`"),
])
def test_bad_quant_configs_are_named(broken, edit, message):
    _edit_quant(broken, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken, CPU, torch.float32)


@pytest.mark.gpu
def test_op_on_cuda_equals_the_dequantized_model(export):
    """`dlmc::nvfp4_moe` (gelu_tanh, Triton gate/up) against the experts dequantized at load,
    both with bf16 activations on the GPU, each layer fed the same input; "auto" packs on a
    GPU."""
    cuda = torch.device("cuda")
    loaded = load_model(export, cuda, torch.bfloat16)
    assert loaded.precision == "nvfp4"
    assert not loaded.model.model.decoder.layers[0].experts.use_reference
    dense = load_model(export, cuda, torch.bfloat16, precision="bf16").model
    want, layers_want = _passes(dense)
    got, _ = _passes(loaded.model, forced=layers_want)
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) < 8e-3
