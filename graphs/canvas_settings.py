"""Settings of DiffusionGemma's canvas decoder, read from a checkpoint's generation_config.json.

`CanvasSettings` holds what the decoding rules in `dlmc.graphs.canvas_rules` need: the
temperature schedule, the entropy bound, the stopping test, the EOS and pad ids and the output
length. `canvas_settings_from_generation_config` reads them with the key names the checkpoint's
file uses (transformers' `DiffusionGemmaGenerationConfig`, the bound nested in
`sampler_config`); a key the file lacks takes transformers' built-in default, and explicit
overrides win over both. `canvas_length` is a model setting (config.json), passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dlmc.errors import ConfigError

# transformers' `DiffusionGemmaGenerationConfig._get_default_generation_params`: what
# `generate` uses for a key the checkpoint's generation config leaves unset.
HF_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 256,
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}
SAMPLER_CLASS = "EntropyBoundSamplerConfig"
# The sampler settings a request may set besides max_new_tokens (LLM.generate's keywords, the
# CLI's and the server's options of the same names; LLaDA2's decoder refuses them by name).
CANVAS_KEYS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
               "confidence_threshold")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float that a float holds (10**400 does not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"CanvasSettings.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class CanvasSettings:
    """How one DiffusionGemma canvas is denoised and appended (defaults: the checkpoint's).

    `t_min`/`t_max`: temperature at the last/first denoising step. `entropy_bound`: the
    acceptance budget in nats. Stopping: argmax unchanged for `stability_threshold` steps and
    mean entropy of the tempered logits below `confidence_threshold`. `eos_token_ids` may be
    empty (no EOS rule). The output holds `canvas_count` canvases, so it may pass
    `max_new_tokens` by up to `canvas_length - 1` tokens, as transformers' does.
    """

    canvas_length: int = 256
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_ids: tuple[int, ...] = (1, 106, 50)
    pad_token_id: int = 0
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        _check(
            _is_int(self.canvas_length) and self.canvas_length >= 1,
            "canvas_length", "an integer >= 1", self.canvas_length,
        )
        _check(
            _is_int(self.max_denoising_steps) and 1 <= self.max_denoising_steps < 2**31,
            "max_denoising_steps", "an integer in [1, 2**31 - 1]", self.max_denoising_steps,
        )
        _check(_is_number(self.t_min) and self.t_min >= 0, "t_min", "a number >= 0", self.t_min)
        _check(
            _is_number(self.t_max) and self.t_max > self.t_min,
            "t_max", f"a number > t_min ({self.t_min!r})", self.t_max,
        )
        _check(
            _is_number(self.entropy_bound) and self.entropy_bound > 0,
            "entropy_bound", "a number > 0 (nats)", self.entropy_bound,
        )
        _check(
            _is_int(self.stability_threshold) and 0 <= self.stability_threshold < 2**31,
            "stability_threshold", "an integer in [0, 2**31 - 1]", self.stability_threshold,
        )
        _check(
            _is_number(self.confidence_threshold) and self.confidence_threshold > 0,
            "confidence_threshold", "a number > 0 (nats)", self.confidence_threshold,
        )
        _check(
            isinstance(self.eos_token_ids, tuple)
            and all(_is_int(i) and i >= 0 for i in self.eos_token_ids),
            "eos_token_ids", "a tuple of integer token ids >= 0", self.eos_token_ids,
        )
        _check(
            _is_int(self.pad_token_id) and self.pad_token_id >= 0,
            "pad_token_id", "an integer token id >= 0", self.pad_token_id,
        )
        _check(
            self.pad_token_id not in self.eos_token_ids,
            "pad_token_id", f"an id outside eos_token_ids {self.eos_token_ids}", self.pad_token_id,
        )
        _check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens", "an integer >= 1", self.max_new_tokens,
        )
        # The rule compares tensors with these: as floats, 2**64 is a bound like any other.
        for name in ("t_min", "t_max", "entropy_bound", "confidence_threshold"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def history_depth(self) -> int:
        """Argmax canvases the stopping rule keeps: `stability_threshold`, or the step budget
        when that is smaller (a canvas takes at most `max_denoising_steps` steps, so a
        threshold past it is never met either way, and its history need not be kept)."""
        return min(self.stability_threshold, self.max_denoising_steps)

    @property
    def canvas_count(self) -> int:
        """Canvases appended at most: `ceil(max_new_tokens / canvas_length)`."""
        return -(-self.max_new_tokens // self.canvas_length)


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    """`eos_token_id` as the file has it (an id or a list of ids) -> a tuple of ids."""
    if value is None:
        return ()
    if _is_int(value):
        return (value,)
    if isinstance(value, (list, tuple)) and all(_is_int(i) for i in value):
        return tuple(value)
    raise ConfigError(f"{source}: eos_token_id must be an integer or a list of integers, "
                      f"got {value!r}")


def _entropy_bound(value: Any, source: str) -> Any:
    """The bound inside `sampler_config` ({"_cls_name": ..., "entropy_bound": ...})."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or "entropy_bound" not in value:
        raise ConfigError(f"{source}: sampler_config must be an object with an 'entropy_bound' "
                          f"key, got {value!r}")
    kind = value.get("_cls_name", SAMPLER_CLASS)
    if kind != SAMPLER_CLASS:
        raise ConfigError(f"{source}: sampler_config._cls_name must be {SAMPLER_CLASS!r} (the "
                          f"only sampler of this architecture), got {kind!r}")
    return value["entropy_bound"]


def canvas_settings_from_generation_config(
    generation_config: Mapping[str, Any],
    canvas_length: int,
    overrides: Mapping[str, Any] | None = None,
    source: str = "generation_config.json",
) -> CanvasSettings:
    """`CanvasSettings` from a checkpoint's generation_config.json (parsed to a dict).

    Keys read: `max_denoising_steps`, `max_new_tokens`, `t_min`, `t_max`,
    `stability_threshold`, `confidence_threshold`, `sampler_config.entropy_bound`,
    `eos_token_id` (an id or a list) and `pad_token_id`; other keys are ignored (`max_length`
    too: the output length is `max_new_tokens`). A key that is absent or null takes
    transformers' default (`HF_DEFAULTS`; no EOS ids; `pad_token_id` has none and must be given).
    `overrides` maps `CanvasSettings` field names to values that win over the file; a None
    value means "not given". `source` names the file in errors.
    """
    names = {f.name for f in fields(CanvasSettings)}
    unknown = sorted(set(overrides or {}) - names)
    if unknown:
        raise ConfigError(f"unknown canvas setting(s) {unknown}; expected some of {sorted(names)}")
    read = dict(HF_DEFAULTS)
    for key in ("max_denoising_steps", "max_new_tokens", "t_min", "t_max",
                "stability_threshold", "confidence_threshold"):
        if generation_config.get(key) is not None:
            read[key] = generation_config[key]
    bound = _entropy_bound(generation_config.get("sampler_config"), source)
    if bound is not None:
        read["entropy_bound"] = bound
    read["eos_token_ids"] = _eos_ids(generation_config.get("eos_token_id"), source)
    if generation_config.get("pad_token_id") is not None:
        read["pad_token_id"] = generation_config["pad_token_id"]
    read["canvas_length"] = canvas_length
    read.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if "pad_token_id" not in read:
        raise ConfigError(f"{source}: pad_token_id is missing; pass it as an override "
                          "(tokens after EOS become pad)")
    if isinstance(read["eos_token_ids"], list):
        read["eos_token_ids"] = tuple(read["eos_token_ids"])
    try:
        return CanvasSettings(**read)
    except ConfigError as error:
        raise ConfigError(f"{source} or its overrides: {error}") from None
