"""Mask and EOS token ids: paper_decoding.json, then generation_config.json, then the
tokenizer, then the LLaDA2 defaults."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLADA2_MASK_ID = 156895
LLADA2_EOS_ID = 156892

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecialIds:
    mask_token_id: int | None  # None: the model has no mask token (DiffusionGemma)
    eos_token_id: int
    source: str  # where each id came from, for the run record


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        log.warning("%s: not valid JSON (%s); ignoring it for special token ids", path, exc)
        return {}
    return raw if isinstance(raw, dict) else {}


def _first_int(value: Any) -> int | None:
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _nested(raw: dict[str, Any]) -> list[dict[str, Any]]:
    sections = [raw.get(k) for k in ("decoding", "orl", "paper", "generation", "sampler")]
    return [s for s in sections if isinstance(s, dict)] + [raw]


def resolve_special_ids(
    checkpoint: Path, tokenizer_ids: Callable[[], dict[str, int | None]] | None = None
) -> SpecialIds:
    """Look each id up in order; `tokenizer_ids` is called only if the files lack one."""
    sources: list[tuple[str, list[dict[str, Any]]]] = [
        ("paper_decoding.json", _nested(_read_json(checkpoint / "paper_decoding.json"))),
        ("generation_config.json", [_read_json(checkpoint / "generation_config.json")]),
    ]
    found: dict[str, tuple[int, str]] = {}
    for key in ("mask_token_id", "eos_token_id"):
        for name, sections in sources:
            for section in sections:
                value = _first_int(section.get(key))
                if value is not None and key not in found:
                    found[key] = (value, name)
    if len(found) < 2 and tokenizer_ids is not None:
        try:
            from_tok = tokenizer_ids()
        except Exception as exc:  # no tokenizer: fall through to the defaults
            log.debug("tokenizer not available for special ids: %s", exc)
            from_tok = {}
        for key, value in from_tok.items():
            if value is not None and key not in found:
                found[key] = (int(value), "tokenizer")
    mask = found.get("mask_token_id", (LLADA2_MASK_ID, "LLaDA2 default"))
    eos = found.get("eos_token_id", (LLADA2_EOS_ID, "LLaDA2 default"))
    return SpecialIds(mask[0], eos[0], f"mask from {mask[1]}, eos from {eos[1]}")
