"""Typed, frozen configuration of a `diffusion_gemma` checkpoint (DiffusionGemma-26B-A4B and
same-architecture fine-tunes), parsed from its config.json: the text model and the decoder only.

config.json nests the text model under `text_config`; field names follow its keys. The full
(global) layers' head size and KV heads come from `global_head_dim` /
`num_global_key_value_heads` (the released checkpoints) or from a `per_layer_config` table (what
transformers writes when it saves the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dlmc.errors import CheckpointError
from dlmc.models.config import read_json_object

MODEL_TYPE = "diffusion_gemma"
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
# transformers' defaults where config.json may leave a key out.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
REQUIRED_TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "num_experts",
    "top_k_experts", "moe_intermediate_size",
)
TEXT_KEYS_WITH_DEFAULTS = (
    "rms_norm_eps", "final_logit_softcapping", "hidden_activation", "tie_word_embeddings",
    "attention_bias", "pad_token_id", "bos_token_id", "max_position_embeddings",
)
# Top-level ids of the image placeholders (the prompt side of the vision path, not loaded).
IMAGE_ID_KEYS = ("image_token_id", "boi_token_id", "eoi_token_id")


@dataclass(frozen=True)
class RopeParameters:
    """One layer type's `rope_parameters` entry.

    `default` rotates every dim of the head; `proportional` rotates the first
    `int(partial_rotary_factor * head_dim // 2)` angle pairs with exponents over the whole head
    dim and leaves the other pairs unrotated (their inverse frequency is 0).
    """

    rope_type: str
    rope_theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    name: str = field(default="text_config.rope_parameters", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"config.json: `{self.name}.rope_type` must be one of {', '.join(ROPE_TYPES)}, "
                f"got {self.rope_type!r}"
            )
        for key in ("rope_theta", "partial_rotary_factor", "factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise CheckpointError(
                    f"config.json: `{self.name}.{key}` must be a positive number, got {value!r}"
                )
        if self.partial_rotary_factor > 1:
            raise CheckpointError(
                f"config.json: `{self.name}.partial_rotary_factor` must be in (0, 1], "
                f"got {self.partial_rotary_factor}"
            )
        if self.rope_type == "default" and (self.partial_rotary_factor != 1 or self.factor != 1):
            raise CheckpointError(
                f"config.json: `{self.name}` with rope_type 'default' must rotate the whole "
                "head (partial_rotary_factor 1, no factor); use rope_type 'proportional'"
            )

    def rotated_pairs(self, head_dim: int) -> int:
        """How many (i, i + head_dim/2) pairs rotate; the rest see cos 1, sin 0."""
        return int(self.partial_rotary_factor * head_dim // 2)


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """Architecture of a `diffusion_gemma` checkpoint's text model and decoder.

    Sliding layers use `head_dim` and `num_key_value_heads` with K, V from `k_proj`, `v_proj`;
    full layers use `global_head_dim` and `num_global_key_value_heads` with V taken from the raw
    `k_proj` output (no `v_proj`). Validation names the bad config.json key.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    sliding_rope: RopeParameters
    full_rope: RopeParameters
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    canvas_length: int = 256
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    bos_token_id: int = 2
    max_position_embeddings: int = 262_144
    image_token_ids: tuple[int, ...] = ()  # image, begin-of-image, end-of-image placeholders

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
            "num_global_key_value_heads", "sliding_window", "num_experts", "top_k_experts",
            "moe_intermediate_size", "canvas_length", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(
                    f"config.json: `{_key(name)}` must be a positive integer, got {value!r}"
                )
        self._check_layer_types()
        for name in ("head_dim", "global_head_dim"):
            if getattr(self, name) % 2:
                raise CheckpointError(
                    f"config.json: `{_key(name)}` must be even (rotate-half RoPE), "
                    f"got {getattr(self, name)}"
                )
        for name in ("num_key_value_heads", "num_global_key_value_heads"):
            if self.num_attention_heads % getattr(self, name):
                raise CheckpointError(
                    f"config.json: `text_config.num_attention_heads` "
                    f"({self.num_attention_heads}) must be a multiple of `{_key(name)}` "
                    f"({getattr(self, name)})"
                )
        if self.top_k_experts > self.num_experts:
            raise CheckpointError(
                f"config.json: `text_config.top_k_experts` ({self.top_k_experts}) exceeds "
                f"`text_config.num_experts` ({self.num_experts})"
            )
        if self.full_rope.rotated_pairs(self.global_head_dim) < 1:
            raise CheckpointError(
                "config.json: `text_config.rope_parameters.full_attention.partial_rotary_factor` "
                f"({self.full_rope.partial_rotary_factor}) rotates no pair of the "
                f"{self.global_head_dim}-dim head"
            )
        for name in ("rms_norm_eps", "final_logit_softcapping"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise CheckpointError(
                    f"config.json: `{_key(name)}` must be a positive number, got {value!r}"
                )
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise CheckpointError(
                "config.json: `text_config.hidden_activation` must be 'gelu_pytorch_tanh', "
                f"got {self.hidden_activation!r}"
            )
        if self.tie_word_embeddings is not True:
            raise CheckpointError(
                "config.json: `tie_word_embeddings` must be true (the embedding is the lm_head "
                "and the encoder shares the decoder's weights)"
            )
        if self.attention_bias is not False:
            raise CheckpointError("config.json: `text_config.attention_bias` = true is not "
                                  "supported")
        if not self.eos_token_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.eos_token_ids
        ):
            raise CheckpointError(
                "config.json: `eos_token_id` must be a token id or a non-empty list of them, "
                f"got {list(self.eos_token_ids)!r}"
            )

    def _check_layer_types(self) -> None:
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != (
                self.num_hidden_layers):
            raise CheckpointError(
                "config.json: `text_config.layer_types` must list one type per layer "
                f"({self.num_hidden_layers}), got {self.layer_types!r}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise CheckpointError(
                    f"config.json: `text_config.layer_types[{i}]` must be one of "
                    f"{', '.join(LAYER_TYPES)}, got {kind!r}"
                )
        if self.layer_types[-1] != FULL:  # transformers forces it, so weights follow a full layer
            raise CheckpointError(
                f"config.json: `text_config.layer_types[{self.num_hidden_layers - 1}]` (the last "
                f"layer) must be {FULL!r}, got {self.layer_types[-1]!r}"
            )

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads if self.is_sliding(layer) else (
            self.num_global_key_value_heads)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a sliding layer (keys `q - window < j <= q` when causal); None
        on full layers."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DiffusionGemmaConfig:
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(
                f"{source}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}"
            )
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{source}: `text_config` must be an object, got {text!r}")
        missing = [f"text_config.{k}" for k in REQUIRED_TEXT_KEYS if text.get(k) is None]
        if missing:
            raise CheckpointError(f"{source}: missing required key(s) {', '.join(missing)}")
        if text.get("use_bidirectional_attention") not in (None, "vision"):
            raise CheckpointError(
                f"{source}: `text_config.use_bidirectional_attention` "
                f"{text['use_bidirectional_attention']!r} is not supported (the encoder is "
                "causal over text; expected null or 'vision')"
            )
        layer_types = text["layer_types"]
        if not isinstance(layer_types, list):
            raise CheckpointError(
                f"{source}: `text_config.layer_types` must be a list, got {layer_types!r}"
            )
        kwargs: dict[str, Any] = {k: text[k] for k in REQUIRED_TEXT_KEYS}
        kwargs["layer_types"] = tuple(layer_types)
        kwargs.update({k: text[k] for k in TEXT_KEYS_WITH_DEFAULTS if text.get(k) is not None})
        kwargs["global_head_dim"], kwargs["num_global_key_value_heads"] = _global_attention(
            text, layer_types, source)
        rope = text.get("rope_parameters") or DEFAULT_ROPE
        kwargs["sliding_rope"] = _rope(rope, SLIDING, source)
        kwargs["full_rope"] = _rope(rope, FULL, source)
        if raw.get("tie_word_embeddings") is not None:
            kwargs["tie_word_embeddings"] = raw["tie_word_embeddings"]
        if raw.get("canvas_length") is not None:
            kwargs["canvas_length"] = raw["canvas_length"]
        kwargs["image_token_ids"] = tuple(
            raw[k] for k in IMAGE_ID_KEYS if isinstance(raw.get(k), int))
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        if eos is not None:
            kwargs["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: Path) -> DiffusionGemmaConfig:
        return cls.from_dict(read_json_object(path), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config.json of this architecture (text model and decoder; no `vision_config`):
        `from_dict` reads it back to an equal config, and transformers'
        `DiffusionGemmaConfig(**d)` builds the same text model from it."""
        text: dict[str, Any] = {k: getattr(self, k) for k in (
            *REQUIRED_TEXT_KEYS, *TEXT_KEYS_WITH_DEFAULTS, "global_head_dim",
            "num_global_key_value_heads") if k != "eos_token_id"}
        text["layer_types"] = list(self.layer_types)
        text["rope_parameters"] = {kind: _rope_dict(rope) for kind, rope in (
            (SLIDING, self.sliding_rope), (FULL, self.full_rope))}
        raw: dict[str, Any] = {
            "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": MODEL_TYPE,
            "canvas_length": self.canvas_length, "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_ids), "text_config": text}
        # The ids in `from_dict`'s key order (the config keeps which of them, not their keys).
        raw.update(zip(IMAGE_ID_KEYS, self.image_token_ids, strict=False))
        return raw


TOP_LEVEL_FIELDS = {"canvas_length", "tie_word_embeddings", "eos_token_ids"}


def _key(field: str) -> str:
    """The config.json key of dataclass field `field`."""
    if field == "eos_token_ids":
        return "eos_token_id"
    return field if field in TOP_LEVEL_FIELDS else f"text_config.{field}"


def _global_attention(text: dict[str, Any], layer_types: list[Any], source: str
                      ) -> tuple[int, int]:
    """(head dim, KV heads) of the full layers: from `per_layer_config` when present (every full
    layer overridden alike, nothing else), else `global_head_dim` / `num_global_key_value_heads`
    with transformers' defaults (512; the sliding layers' KV heads)."""
    table = text.get("per_layer_config")
    if table is None:
        kv_heads = text.get("num_global_key_value_heads")
        head_dim = text.get("global_head_dim")
        return (DEFAULT_GLOBAL_HEAD_DIM if head_dim is None else head_dim,
                text["num_key_value_heads"] if kv_heads is None else kv_heads)
    full = {i for i, kind in enumerate(layer_types) if kind == FULL}
    if not isinstance(table, dict) or not all(str(k).isdigit() for k in table):
        raise CheckpointError(
            f"{source}: `text_config.per_layer_config` must map layer indices to overrides, "
            f"got {table!r}"
        )
    overrides = {int(k): v for k, v in table.items()}
    values = list(overrides.values())
    if set(overrides) != full or any(v != values[0] for v in values) or not isinstance(
            values[0], dict) or not set(values[0]) <= {"head_dim", "num_key_value_heads"}:
        raise CheckpointError(
            f"{source}: `text_config.per_layer_config` must give every full_attention layer "
            f"({sorted(full)}) the same head_dim / num_key_value_heads and nothing else, got "
            f"{table!r}"
        )
    return (values[0].get("head_dim", text["head_dim"]),
            values[0].get("num_key_value_heads", text["num_key_value_heads"]))


def _rope_dict(rope: RopeParameters) -> dict[str, Any]:
    """One layer type's `rope_parameters` entry as config.json writes it."""
    entry: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.rope_theta}
    if rope.rope_type != "default":
        entry["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.factor != 1:
        entry["factor"] = rope.factor
    return entry


def _rope(rope: Any, layer_type: str, source: str) -> RopeParameters:
    name = f"text_config.rope_parameters.{layer_type}"
    entry = rope.get(layer_type, DEFAULT_ROPE[layer_type]) if isinstance(rope, dict) else None
    if not isinstance(entry, dict) or "rope_theta" not in entry:
        raise CheckpointError(
            f"{source}: `{name}` must be an object with rope_type and rope_theta, got {entry!r}"
        )
    known = {f.name for f in fields(RopeParameters)} - {"name"}
    unknown = set(entry) - known
    if unknown:
        raise CheckpointError(f"{source}: `{name}` has unsupported key(s) {sorted(unknown)}")
    return RopeParameters(**{"rope_type": "default", **entry, "name": name})
