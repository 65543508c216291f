"""Tolerant reader of a checkpoint's paper_decoding.json (docs/llada2.md §6).

Flat or nested under decoding/orl/paper/generation/sampler (nested wins); keys matched
case-insensitively with '-' read as '_'; aliases; numeric strings coerced; a bad value falls
back to the default with a warning naming the file and key; unknown keys are warned about.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SECTIONS = ("decoding", "orl", "paper", "generation", "sampler")
ALIASES = {
    "threshold": (
        "threshold",
        "mask_threshold",
        "tau_mask",
        "m2t_threshold",
        "confidence_threshold",
    ),
    "edit_threshold": ("edit_threshold", "editing_threshold", "tau_edit", "t2t_threshold"),
    "max_new_tokens": ("max_new_tokens", "gen_length", "max_tokens"),
    "max_refine_steps": (
        "refine_steps",
        "max_post_steps",
        "max_post_edit_steps",
        "refinement_steps",
        "post_steps",
        "max_refine_steps",
    ),
    "self_conditioning": ("self_conditioning", "self_cond", "use_self_conditioning"),
    "block_length": ("block_length", "block_size"),
    "temperature": ("temperature",),
}
# Keys that are read elsewhere (special ids) and so are not "unknown".
KNOWN_ELSEWHERE = {"mask_token_id", "eos_token_id", "pad_token_id"}
LOOKUP = {alias: field for field, aliases in ALIASES.items() for alias in aliases}


def _norm(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    flat = {_norm(k): v for k, v in raw.items() if not isinstance(v, dict)}
    for key, value in raw.items():
        if isinstance(value, dict) and _norm(key) in SECTIONS:
            flat.update({_norm(k): v for k, v in value.items() if not isinstance(v, dict)})
    return flat


def _coerce(field: str, value: Any) -> Any:
    if field == "edit_threshold" and (value is None or value is False):
        return None
    if field == "self_conditioning":
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, str):
        value = float(value.strip())
    if field in ("max_new_tokens", "max_refine_steps", "block_length"):
        if float(value) != int(value):
            raise ValueError("expected an integer")
        return int(value)
    return float(value)


def read_flat(path: Path) -> dict[str, Any]:
    """The file's settings as one flat dict: keys normalised, nested sections winning over
    top-level keys; empty (with a warning) if the file is not a JSON object, empty if absent."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        log.warning("%s: not valid JSON (%s); using the paper's default settings", path, exc)
        return {}
    if not isinstance(raw, dict):
        log.warning("%s: expected a JSON object; using the paper's default settings", path)
        return {}
    return _flatten(raw)


def read_paper_decoding(path: Path, defaults: Any) -> dict[str, Any]:
    """Settings found in `path` as field overrides of `defaults` (a `DecodeConfig`, whose
    validation checks each value's range); empty if the file is absent."""
    found: dict[str, Any] = {}
    for key, value in read_flat(path).items():
        field = LOOKUP.get(key)
        if field is None:
            if key not in KNOWN_ELSEWHERE:
                log.warning("%s: unknown key %r ignored", path, key)
            continue
        try:
            candidate = _coerce(field, value)
            dataclasses.replace(defaults, **{field: candidate})  # range check
        except (ValueError, TypeError, Exception) as exc:
            log.warning(
                "%s: key %r has invalid value %r (%s); using the default %r",
                path,
                key,
                value,
                exc,
                getattr(defaults, field),
            )
            continue
        found[field] = candidate
    return found
