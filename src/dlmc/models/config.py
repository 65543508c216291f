"""Typed, frozen model configuration parsed from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dlmc.errors import CheckpointError


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json) as a dict; a missing file, invalid JSON or another
    top-level type is a `CheckpointError` naming the file."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.json not found") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw

SUPPORTED_MODEL_TYPES = ("llada2_moe",)


@dataclass(frozen=True)
class LLaDA2Config:
    """Architecture of a `llada2_moe` checkpoint (LLaDA2.0-mini, LLaDA2.1-mini and fine-tunes).

    Field names follow config.json. Validation names the bad field.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    rope_theta: float = 600000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False
    norm_topk_prob: bool = True
    moe_router_enable_expert_bias: bool = True
    score_function: str = "sigmoid"
    hidden_act: str = "silu"
    model_type: str = "llada2_moe"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "moe_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(
                    f"config.json: `{name}` must be a positive integer, got {value!r}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                "config.json: `num_attention_heads` must be a multiple of `num_key_value_heads`, "
                f"got {self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if self.num_experts % self.n_group:
            raise CheckpointError(
                f"config.json: `num_experts` ({self.num_experts}) must divide into `n_group` "
                f"({self.n_group}) groups"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise CheckpointError(
                f"config.json: `topk_group` must be in 1..n_group={self.n_group}, "
                f"got {self.topk_group}"
            )
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise CheckpointError(
                f"config.json: `num_experts_per_tok` ({self.num_experts_per_tok}) exceeds the "
                f"experts in the kept groups ({self.topk_group} x "
                f"{self.num_experts // self.n_group})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(
                "config.json: `partial_rotary_factor` x `head_dim` must be an even number in "
                f"1..head_dim, got {self.partial_rotary_factor} x {self.head_dim}"
            )
        if self.score_function != "sigmoid":
            raise CheckpointError(
                f"config.json: `score_function` {self.score_function!r} is not supported "
                "(expected 'sigmoid')"
            )
        if self.hidden_act != "silu":
            raise CheckpointError(
                f"config.json: `hidden_act` {self.hidden_act!r} is not supported (expected 'silu')"
            )
        if self.use_qkv_bias or self.use_bias:
            raise CheckpointError("config.json: `use_qkv_bias`/`use_bias` = true is not supported")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> LLaDA2Config:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unknown model_type {model_type!r}; dlmc supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        raw = dict(raw)
        if raw.get("head_dim") is None and "hidden_size" in raw and "num_attention_heads" in raw:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if raw.get("rope_scaling"):
            raise CheckpointError(
                f"{source}: `rope_scaling` {raw['rope_scaling']!r} is not supported"
            )
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        required = [f.name for f in fields(cls) if _is_required(f) and f.name not in kwargs]
        if required:
            raise CheckpointError(f"{source}: missing required key(s) {', '.join(required)}")
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise CheckpointError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: Path) -> LLaDA2Config:
        return cls.from_dict(read_json_object(path), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["architectures"] = ["LLaDA2MoeModelLM"]
        return out


def _is_required(f: Any) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING
