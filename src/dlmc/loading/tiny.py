"""Built-in tiny checkpoints: the real `llada2_moe` architecture and file format, small and with
random seeded weights (their output is gibberish), created deterministically on first use;
`tiny-diffusiongemma` and `tiny-diffusiongemma-nvfp4` are the same for `diffusion_gemma` (written
by `dlmc.loading.tiny_gemma`).

`write_tiny_checkpoint` is also what the tests use to build checkpoints of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dlmc.cache_dir import dlmc_cache_dir
from dlmc.loading.tiny_tokenizer import EOS_ID, MASK_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer
from dlmc.models.config import LLaDA2Config

TINY_VERSION = "v1"
LM_HEAD_STD = 1.0
BUILTIN_MODELS = ("tiny-llada2", "tiny-llada2-nvfp4", "tiny-diffusiongemma",
                  "tiny-diffusiongemma-nvfp4")
TINY_KV_SCALE = 0.01  # FP8 KV scales written into the NVFP4 variant (amax / 448 of its K, V)

TINY_CONFIG: dict[str, Any] = dict(
    model_type="llada2_moe",
    architectures=["LLaDA2MoeModelLM"],
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=16,
    num_experts_per_tok=4,
    num_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    use_qk_norm=True,
    use_qkv_bias=False,
    use_bias=False,
    norm_topk_prob=True,
    moe_router_enable_expert_bias=True,
    score_function="sigmoid",
    hidden_act="silu",
    pad_token_id=EOS_ID,
    dtype="bfloat16",
)

# The ORL paper's decoder settings (docs/llada2.md §6), with a short default length for the demo.
TINY_PAPER_DECODING = {
    "decoding": {
        "threshold": 0.85,
        "edit_threshold": 0.5,
        "refine_steps": 16,
        "block_length": 32,
        "max_new_tokens": 128,
        "temperature": 0.0,
    },
    "mask_token_id": MASK_ID,
    "eos_token_id": EOS_ID,
}


def tiny_state_dict(config: LLaDA2Config, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 tensors with the HF names and shapes of a `llada2_moe` checkpoint.

    Scales are chosen so that logits are peaked enough for the decoder to commit several
    tokens per round and to edit some, like a trained model does.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = config.hidden_size, config.head_dim

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    sd = {"model.word_embeddings.weight": rand(config.vocab_size, hidden, std=1.0)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        sd[f"{p}.input_layernorm.weight"] = (1 + rand(hidden, std=0.1).float()).bfloat16()
        sd[f"{p}.post_attention_layernorm.weight"] = (1 + rand(hidden, std=0.1).float()).bfloat16()
        sd[f"{p}.attention.query_key_value.weight"] = rand(qkv_rows, hidden, std=hidden**-0.5)
        sd[f"{p}.attention.query_layernorm.weight"] = (
            1 + rand(head_dim, std=0.1).float()
        ).bfloat16()
        sd[f"{p}.attention.key_layernorm.weight"] = (1 + rand(head_dim, std=0.1).float()).bfloat16()
        sd[f"{p}.attention.dense.weight"] = rand(hidden, hidden, std=hidden**-0.5)
        if not config.is_moe_layer(layer):
            inter = config.intermediate_size
            sd[f"{p}.mlp.gate_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
            sd[f"{p}.mlp.up_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
            sd[f"{p}.mlp.down_proj.weight"] = rand(hidden, inter, std=inter**-0.5)
            continue
        inter = config.moe_intermediate_size
        sd[f"{p}.mlp.gate.weight"] = rand(config.num_experts, hidden, std=hidden**-0.5)
        sd[f"{p}.mlp.gate.expert_bias"] = torch.randn(config.num_experts, generator=gen) * 0.1
        for e in range(config.num_experts):
            sd[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
            sd[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden, std=hidden**-0.5)
            sd[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter, std=inter**-0.5)
        shared = inter * config.num_shared_experts
        sd[f"{p}.mlp.shared_experts.gate_proj.weight"] = rand(shared, hidden, std=hidden**-0.5)
        sd[f"{p}.mlp.shared_experts.up_proj.weight"] = rand(shared, hidden, std=hidden**-0.5)
        sd[f"{p}.mlp.shared_experts.down_proj.weight"] = rand(hidden, shared, std=shared**-0.5)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    # Printable ASCII (and EOS) rows are strong, the rest weak: readable (if meaningless) text.
    row_std = torch.full((config.vocab_size, 1), 0.05)
    row_std[32:127] = LM_HEAD_STD
    row_std[EOS_ID] = LM_HEAD_STD
    sd["lm_head.weight"] = (
        torch.randn(config.vocab_size, hidden, generator=gen) * row_std
    ).bfloat16()
    return sd


def write_tiny_checkpoint(
    directory: Path, seed: int = 0, shards: int = 2, tokenizer: bool = True, **overrides: Any
) -> Path:
    """Write a tiny `llada2_moe` checkpoint (config, sharded safetensors + index, generation
    config, paper_decoding.json, byte-level tokenizer) to `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **overrides}
    config = LLaDA2Config.from_dict(raw)
    sd = tiny_state_dict(config, seed)
    if shards == 1:  # single file, no index, like small HF checkpoints
        save_file(
            {n: t.contiguous() for n, t in sd.items()},
            str(directory / "model.safetensors"),
            metadata={"format": "pt"},
        )
    else:
        _write_shards(directory, sd, shards)
    _write_json(directory / "config.json", raw)
    _write_json(
        directory / "generation_config.json",
        {"mask_token_id": MASK_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID},
    )
    _write_json(directory / "paper_decoding.json", TINY_PAPER_DECODING)
    if tokenizer:
        write_tiny_tokenizer(directory)
    return directory


def _write_shards(directory: Path, sd: dict[str, torch.Tensor], shards: int) -> None:
    names = list(sd)
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        part = names[shard::shards]
        fname = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file(
            {n: sd[n].contiguous() for n in part}, str(directory / fname), metadata={"format": "pt"}
        )
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    _write_json(
        directory / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def ensure_builtin(name: str) -> Path:
    """Path of built-in model `name` in dlmc's cache, written there on first use."""
    target = dlmc_cache_dir() / "models" / f"{name}-{TINY_VERSION}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # left half-written by an interrupted first run
        shutil.rmtree(target, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        if name == "tiny-diffusiongemma-nvfp4":
            from dlmc.loading.tiny_gemma import write_tiny_gemma_nvfp4

            write_tiny_gemma_nvfp4(staging, seed=0)
        elif name.endswith("-nvfp4"):  # ModelOpt-format NVFP4 export of the BF16 tiny model
            from dlmc.quant.export import export_nvfp4

            source = ensure_builtin(name.removesuffix("-nvfp4"))
            layers = TINY_CONFIG["num_hidden_layers"]
            export_nvfp4(source, staging,
                         kv_scales={i: (TINY_KV_SCALE, TINY_KV_SCALE) for i in range(layers)})
        elif name == "tiny-diffusiongemma":
            from dlmc.loading.tiny_gemma import write_tiny_gemma_checkpoint

            write_tiny_gemma_checkpoint(staging, seed=0)
        else:
            write_tiny_checkpoint(staging, seed=0)
        (staging / ".complete").write_text(f"{name} {TINY_VERSION}\n")
        try:
            os.replace(staging, target)
        except OSError:  # another process won the race: keep its copy
            if not (target / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
