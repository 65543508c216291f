"""DiffusionGemma's decoding settings for one request: the checkpoint's generation_config.json,
then (role "orl") its paper_decoding.json, then the request's explicit arguments, in rising
precedence, with where each value came from.

The sampler is transformers' entropy-bound canvas sampler (`dlmc.graphs.canvas_rules`); its
settings are `CanvasSettings`. LLaDA2's options (`threshold`, `edit_threshold`,
`max_refine_steps`, `block_length`, `top_k`, `top_p`, a temperature) do not apply to it and are
refused by name; the temperature follows the `t_max .. t_min` schedule instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmc.engine.decode_config import check_seed
from dlmc.engine.paper_decoding import ALIASES as LLADA2_ALIASES
from dlmc.engine.paper_decoding import KNOWN_ELSEWHERE, read_flat
from dlmc.errors import ConfigError
from dlmc.graphs.canvas_settings import CANVAS_KEYS, HF_DEFAULTS, CanvasSettings
from dlmc.graphs.canvas_settings import canvas_settings_from_generation_config as from_file
from dlmc.models.diffusion_gemma_config import DiffusionGemmaConfig

log = logging.getLogger(__name__)

CANVAS_ROLES = ("orl",)
# The sampler settings a request may give (CanvasSettings fields; canvas_length, the EOS and
# pad ids are the checkpoint's).
CANVAS_OPTIONS = ("max_new_tokens", *CANVAS_KEYS)
LLADA2_OPTIONS = ("threshold", "edit_threshold", "max_refine_steps", "block_length", "top_k",
                  "top_p", "temperature")
# paper_decoding.json keys read for this sampler. `confidence_threshold` is not among them:
# in that file it names LLaDA2's commit threshold, not this sampler's stopping entropy.
PAPER_ALIASES = {
    "max_new_tokens": ("max_new_tokens", "gen_length", "max_tokens"),
    "max_denoising_steps": ("max_denoising_steps", "denoising_steps"),
    "t_min": ("t_min",),
    "t_max": ("t_max",),
    "entropy_bound": ("entropy_bound",),
    "stability_threshold": ("stability_threshold",),
}
PAPER_LOOKUP = {alias: name for name, aliases in PAPER_ALIASES.items() for alias in aliases}
LLADA2_KEYS = {alias for aliases in LLADA2_ALIASES.values() for alias in aliases}


@dataclass(frozen=True)
class CanvasDecodeConfig:
    """How one DiffusionGemma request is decoded: the sampler's settings, the seed of its
    random draws (None: a fresh one) and where each setting came from."""

    settings: CanvasSettings
    seed: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_seed(self.seed)

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    @property
    def block_length(self) -> int:
        """The unit the output grows by: one canvas."""
        return self.settings.canvas_length

    def to_dict(self) -> dict[str, Any]:
        """The effective settings, for `GenerateResult.settings`."""
        out = dataclasses.asdict(self.settings)
        out["eos_token_ids"] = list(self.settings.eos_token_ids)
        return {**out, "seed": self.seed, "sources": dict(self.sources)}


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} if absent; malformed is an error naming the file."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def read_paper_canvas_settings(path: Path, base: CanvasSettings) -> dict[str, Any]:
    """The sampler settings a paper_decoding.json gives, checked against `base` one by one (an
    invalid value is warned about and dropped); LLaDA2's options are noted as not applying."""
    found: dict[str, Any] = {}
    for key, value in read_flat(path).items():
        name = PAPER_LOOKUP.get(key)
        if name is None:
            if key in LLADA2_KEYS:
                log.info("%s: %r is a LLaDA2 decoding setting; DiffusionGemma's entropy-bound "
                         "sampler does not use it", path, key)
            elif key not in KNOWN_ELSEWHERE:
                log.warning("%s: unknown key %r ignored", path, key)
            continue
        try:
            dataclasses.replace(base, **{name: value})
        except (ConfigError, TypeError) as exc:
            log.warning("%s: key %r has invalid value %r (%s); using %r", path, key, value, exc,
                        getattr(base, name))
            continue
        found[name] = value
    return found


def resolve_canvas_config(
    role: str, checkpoint: Path, config: DiffusionGemmaConfig, overrides: Mapping[str, Any],
) -> CanvasDecodeConfig:
    """transformers' defaults < generation_config.json < paper_decoding.json (role "orl") <
    `overrides` (LLM.stream's arguments; None means not given, and so does temperature 0.0,
    its default; `edit_threshold` given at all is refused). EOS and pad ids the generation
    config lacks come from config.json."""
    if role not in CANVAS_ROLES:
        raise ConfigError(f"role {role!r}: a diffusion_gemma checkpoint takes role 'orl' (its "
                          "generation_config.json, then paper_decoding.json)")
    given = {k: v for k, v in overrides.items() if v is not None or k == "edit_threshold"}
    if given.get("temperature") == 0.0:
        given.pop("temperature")
    seed = given.pop("seed", None)
    for name in given:
        if name in LLADA2_OPTIONS:
            raise ConfigError(
                f"decoding option `{name}`: a LLaDA2 setting; DiffusionGemma's entropy-bound "
                f"sampler takes {', '.join(CANVAS_OPTIONS)} and seed (its temperature follows "
                "t_max .. t_min)")
        if name not in CANVAS_OPTIONS:
            raise ConfigError(f"unknown decoding option `{name}`; DiffusionGemma takes "
                              f"{', '.join(CANVAS_OPTIONS)} and seed")
    generation = _read_json(checkpoint / "generation_config.json")
    sources = {k: "generation_config.json" if generation.get(k) is not None else "default"
               for k in HF_DEFAULTS}
    sampler = generation.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        sources["entropy_bound"] = "generation_config.json"
    fallback: dict[str, Any] = {}  # ids the generation config lacks: config.json's
    for key, field_name, value in (("eos_token_id", "eos_token_ids", list(config.eos_token_ids)),
                                   ("pad_token_id", "pad_token_id", config.pad_token_id)):
        sources[field_name] = "generation_config.json"
        if generation.get(key) is None:
            fallback[key], sources[field_name] = value, "config.json"
    base = from_file({**generation, **fallback}, config.canvas_length,
                     source=str(checkpoint / "generation_config.json"))
    paper: dict[str, Any] = {}
    if role == "orl":
        paper = read_paper_canvas_settings(checkpoint / "paper_decoding.json", base)
        sources.update({k: "paper_decoding.json" for k in paper})
    try:
        settings = dataclasses.replace(base, **{**paper, **given})
    except ConfigError as exc:  # name the argument at fault, as the other options do
        named = re.search(r"CanvasSettings\.(\w+)", str(exc))
        name = named.group(1) if named else ", ".join(given)
        where = sources.get(name, "default")
        where = "transformers' default" if where == "default" else f"from {where}"
        origin = "" if name in given or not given else (
            f" ({name} is {where}; the arguments {', '.join(f'`{k}`' for k in given)} do "
            "not fit it)")
        raise ConfigError(f"decoding option `{name}`: {exc}{origin}") from None
    sources.update({k: "argument" for k in given})
    return CanvasDecodeConfig(settings, seed, sources)
