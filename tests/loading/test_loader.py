import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmc.errors import CheckpointError, ConfigError
from dlmc.loading.loader import load_model
from dlmc.loading.tiny import write_tiny_checkpoint

CPU = torch.device("cpu")


@pytest.fixture()
def ckpt(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", seed=3, shards=1, tokenizer=False)


def _edit(ckpt, fn):
    file = next(ckpt.glob("*.safetensors"))
    sd = load_file(str(file))
    fn(sd)
    save_file(sd, str(file))
    return file


def test_loads_and_stacks_experts(ckpt):
    loaded = load_model(ckpt, CPU, torch.float32)
    sd = load_file(str(next(ckpt.glob("*.safetensors"))))
    experts = loaded.model.model.layers[2].mlp.experts
    assert experts.up_proj_weight.shape == (16, 32, 64)
    assert torch.equal(
        experts.up_proj_weight[5], sd["model.layers.2.mlp.experts.5.up_proj.weight"].float()
    )
    assert not any(t.is_meta for t in loaded.model.state_dict().values())
    assert not any(t.is_meta for _, t in loaded.model.named_buffers())


def test_missing_tensor_is_named(ckpt):
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    _edit(ckpt, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match=rf"tensor {name} is missing.*\[64, 32\]"):
        load_model(ckpt, CPU, torch.float32)


def test_wrong_shape_names_tensor_file_and_expected(ckpt):
    name = "model.layers.0.attention.dense.weight"
    _edit(ckpt, lambda sd: sd.__setitem__(name, torch.zeros(64, 63, dtype=torch.bfloat16)))
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors.*{name}.*\[64, 63\], expected \[64, 64\]"
    ):
        load_model(ckpt, CPU, torch.float32)


def test_wrong_dtype(ckpt):
    name = "model.norm.weight"
    _edit(ckpt, lambda sd: sd.__setitem__(name, torch.zeros(64, dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match=rf"{name} has dtype U8, expected one of BF16"):
        load_model(ckpt, CPU, torch.float32)


def test_missing_expert_bias_is_zeros(ckpt):
    _edit(ckpt, lambda sd: sd.pop("model.layers.1.mlp.gate.expert_bias"))
    loaded = load_model(ckpt, CPU, torch.float32)
    assert torch.equal(loaded.model.model.layers[1].mlp.gate.expert_bias, torch.zeros(16))


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "mystery"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'mystery'"):
        load_model(ckpt, CPU, torch.float32)


def test_corrupt_safetensors_names_the_file(ckpt):
    file = next(ckpt.glob("*.safetensors"))
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header")
    with pytest.raises(CheckpointError, match=rf"{file.name}: not a readable safetensors file"):
        load_model(ckpt, CPU, torch.float32)


def test_truncated_safetensors(ckpt):
    file = next(ckpt.glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=file.name):
        load_model(ckpt, CPU, torch.float32)


def test_sharded_index_with_missing_shard(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "s", seed=1, shards=2, tokenizer=False)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: listed in"):
        load_model(ckpt, CPU, torch.float32)


def test_precision_checks(ckpt):
    with pytest.raises(ConfigError, match="precision 'fp8'"):
        load_model(ckpt, CPU, torch.float32, precision="fp8")
    with pytest.raises(ConfigError, match="is a BF16 checkpoint"):
        load_model(ckpt, CPU, torch.float32, precision="nvfp4")


def test_loading_into_a_fused_model_is_refused(ckpt):
    """Shared experts are fused after loading; a model fused before it would silently leave row E
    of the stacked experts unset, so the loader names the tensor instead."""
    from dlmc.loading.safetensors_index import SafetensorsIndex
    from dlmc.loading.weights import load_weights
    from dlmc.models.config import LLaDA2Config
    from dlmc.models.llada2 import LLaDA2ForDiffusion
    from dlmc.models.moe import fuse_shared_experts

    config = LLaDA2Config.from_file(ckpt / "config.json")
    with torch.device("meta"):
        model = LLaDA2ForDiffusion(config)
    assert fuse_shared_experts(model) > 0
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.gate_proj_weight stacks 17 experts"):
        load_weights(model, SafetensorsIndex(ckpt), CPU, torch.float32, config.num_experts)


def test_router_weight_is_kept_fp32(ckpt):
    """The router GEMM runs in fp32: its weight is an fp32 buffer, converted once at load."""
    loaded = load_model(ckpt, CPU, torch.bfloat16)
    sd = load_file(str(next(ckpt.glob("*.safetensors"))))
    mlp = loaded.model.model.layers[1].mlp
    assert mlp.gate.weight.dtype == torch.float32
    assert torch.equal(mlp.gate.weight, sd["model.layers.1.mlp.gate.weight"].float())
    assert mlp.experts.up_proj_weight.dtype == torch.bfloat16
