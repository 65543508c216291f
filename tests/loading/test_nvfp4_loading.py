"""A tiny NVFP4 (ModelOpt format) checkpoint loads, equals its dequantized BF16 self, and every
malformed case is an error naming the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmc import LLM
from dlmc.errors import CheckpointError, ConfigError
from dlmc.loading.tiny import write_tiny_checkpoint


def test_nvfp4_logits_equal_dequantized_bf16(nvfp4_dir):
    ids = list(range(60, 110))
    as_nvfp4 = LLM(nvfp4_dir, device="cpu", dtype="fp32", precision="nvfp4")
    as_bf16 = LLM(nvfp4_dir, device="cpu", dtype="fp32", precision="bf16")
    assert as_nvfp4.precision == "nvfp4" and as_bf16.precision == "bf16"
    assert LLM(nvfp4_dir, device="cpu").precision == "bf16"  # auto on CPU
    a, b = as_nvfp4.logits(ids), as_bf16.logits(ids)
    # Same weights; the NVFP4 path rounds expert intermediates to bf16 like the kernel does and
    # keeps the global scale in fp32, the dequantized path rounds weights x global scale to bf16.
    assert (a - b).norm() / b.norm() < 1e-2
    assert bool((a.argmax(-1) == b.argmax(-1)).all())
    assert as_nvfp4.kv_scales.k == (0.5,) * 3 and as_nvfp4.kv_scales.v == (0.25,) * 3
    a = as_nvfp4.generate(prompt_token_ids=ids, max_new_tokens=32)
    assert len(a.token_ids) == 32


@pytest.mark.gpu
def test_nvfp4_logits_equal_dequantized_bf16_on_cuda(nvfp4_dir):
    # The Triton nvfp4_moe op (v3: FP4 decoded in registers) against the same experts
    # dequantized at load (bf16_moe), both with bf16 activations on the GPU.
    ids = list(range(60, 110))
    as_nvfp4 = LLM(nvfp4_dir, device="cuda", precision="nvfp4", mode="eager")
    as_bf16 = LLM(nvfp4_dir, device="cuda", precision="bf16", mode="eager")
    assert as_nvfp4.precision == "nvfp4" and as_bf16.precision == "bf16"
    assert LLM(nvfp4_dir, device="cuda").precision == "nvfp4"  # auto on a GPU
    a, b = as_nvfp4.logits(ids).float(), as_bf16.logits(ids).float()
    assert (a - b).norm() / b.norm() < 2e-2  # bf16 activations: rounding order only
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_fused_shared_expert_logits_match_unfused(nvfp4_dir, monkeypatch):
    """`fuse_shared_experts` on the loaded tiny NVFP4 model (as LLM does on CUDA): the shared
    expert runs as BF16 tail blocks of the Triton op (interpreted here); logits agree with the
    unfused model within bf16 rounding (one fp32 sum instead of two bf16 roundings). Decoded
    tokens are not compared: the tiny random model's joint decode edits near-ties, and a bf16
    rounding flips one edit by the third round (as fusing the BF16 experts does)."""
    from dlmc.bench.round_bench import touched_bytes
    from dlmc.models.moe import MoEBlock, fuse_shared_experts

    ids = list(range(60, 110))
    llm = LLM(nvfp4_dir, device="cpu", dtype="bf16", precision="nvfp4")
    blocks = [m for m in llm.model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        block.experts.use_reference = False  # dlmc::nvfp4_moe under Triton's interpreter
    want = llm.logits(ids).float()
    tokens, positions = torch.tensor(ids[:16]), torch.arange(48, 64)
    nbytes = touched_bytes(llm.model, tokens, positions, prefix=48)
    assert fuse_shared_experts(llm.model) == len(blocks) == 2
    assert touched_bytes(llm.model, tokens, positions, prefix=48) == nbytes  # BF16 bytes kept
    assert all(b.shared_experts is None and b.shared_expert_id == 16 for b in blocks)
    got = llm.logits(ids).float()
    assert (got - want).norm() / want.norm() < 1e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.gpu
def test_fused_shared_expert_on_cuda_matches_separate(nvfp4_dir, monkeypatch):
    """On CUDA LLM fuses the shared expert into the NVFP4 op (graph mode); the same model with
    the shared expert left as its own cuBLAS SwiGLU gives the same logits up to bf16
    rounding."""
    import dlmc.api
    from dlmc.models.moe import MoEBlock

    ids = list(range(60, 110))
    fused = LLM(nvfp4_dir, device="cuda", precision="nvfp4")
    monkeypatch.setattr(dlmc.api, "fuse_shared_experts", lambda model: 0)
    separate = LLM(nvfp4_dir, device="cuda", precision="nvfp4")
    fused_ids = [m.shared_expert_id for m in fused.model.modules() if isinstance(m, MoEBlock)]
    assert fused_ids == [16, 16]
    assert all(m.shared_experts is not None for m in separate.model.modules()
               if isinstance(m, MoEBlock))
    a, b = fused.logits(ids).float(), separate.logits(ids).float()
    assert (a - b).norm() / b.norm() < 1e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert len(fused.generate(prompt_token_ids=ids, max_new_tokens=32).token_ids) == 32


def _rewrite(directory, fn):
    file = directory / "model.safetensors"
    sd = load_file(str(file))
    fn(sd)
    save_file(sd, str(file))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight_scale"),
     r"experts\.3\.up_proj\.weight_scale: missing"),
    (lambda sd: sd.__setitem__("model.layers.2.mlp.experts.0.down_proj.weight_scale",
                               torch.zeros(128, 4).to(torch.float8_e4m3fn)),
     r"down_proj.weight_scale: shape \(128, 4\) is a padded/128x4-swizzled"),
    (lambda sd: sd.__setitem__("model.layers.1.mlp.experts.1.gate_proj.weight_scale_2",
                               torch.ones(2)),
     r"gate_proj.weight_scale_2: expected fp32 scalar"),
    (lambda sd: sd.__setitem__("model.layers.0.attention.v_scale", torch.tensor(-1.0)),
     r"KV scale model.layers.0.attention.v_scale .* is -1.0; expected a positive"),
])
def test_malformed_exports_are_named(tmp_path, nvfp4_dir, edit, message):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(nvfp4_dir, broken)
    _rewrite(broken, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(broken, device="cpu")


def test_unsupported_algo_and_precision_errors(tmp_path, nvfp4_dir):
    import shutil

    bad = tmp_path / "algo"
    shutil.copytree(nvfp4_dir, bad)
    cfg = json.loads((bad / "hf_quant_config.json").read_text())
    cfg["quantization"]["quant_algo"] = "W4A8_AWQ"
    (bad / "hf_quant_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_algo.*W4A8_AWQ"):
        LLM(bad, device="cpu")
    with pytest.raises(ConfigError, match="is a BF16 checkpoint"):
        LLM(write_tiny_checkpoint(tmp_path / "plain", shards=1), device="cpu", precision="nvfp4")


def test_declared_fp8_kv_without_scales_warns_and_uses_one(tmp_path, nvfp4_dir, caplog):
    import shutil

    bare = tmp_path / "noscales"
    shutil.copytree(nvfp4_dir, bare)
    _rewrite(bare, lambda sd: [sd.pop(n) for n in list(sd) if n.endswith(("k_scale", "v_scale"))])
    llm = LLM(bare, device="cpu", dtype="bf16")
    assert llm.kv_scales.k == (1.0,) * 3 and llm.kv_cache_dtype == "fp8"
    assert "declares an FP8 KV cache but has no scale" in caplog.text


def test_declared_fp8_kv_is_the_auto_cache_where_it_runs(nvfp4_dir):
    assert LLM(nvfp4_dir, device="cpu", dtype="bf16", mode="eager").kv_cache_dtype == "fp8"
    assert LLM(nvfp4_dir, device="cpu", dtype="bf16", mode="eager",
               kv_cache_dtype="bf16").kv_cache_dtype == "bf16"
    # Compiled rounds on CPU: the paged cache's CPU attention syncs, so auto keeps BF16 and an
    # explicit FP8 request is refused (on CUDA compiled/graph rounds pick FP8: GPU tests).
    assert LLM(nvfp4_dir, device="cpu", dtype="bf16", mode="compile").kv_cache_dtype == "bf16"
    with pytest.raises(ConfigError, match="'fp8' with mode 'compile' needs a CUDA device"):
        LLM(nvfp4_dir, device="cpu", dtype="bf16", mode="compile", kv_cache_dtype="fp8")


def graph_tokens_and_logits(model_dir) -> tuple[list[int], torch.Tensor]:
    """An NVFP4 model in graph mode on CUDA: 64 generated tokens and the eager logits of the
    whole sequence."""
    llm = LLM(model_dir, device="cuda", precision="nvfp4", mode="graph")
    res = llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=64)
    return res.token_ids, llm.logits(res.prompt_token_ids + res.token_ids)
