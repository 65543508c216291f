"""Decoder settings: typed, frozen, validated; built from a role's defaults, the checkpoint's
paper_decoding.json (under every role) and the request's explicit parameters (in rising
precedence)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from dlmc.engine.paper_decoding import read_paper_decoding
from dlmc.errors import ConfigError

Algorithm = Literal["joint", "threshold"]
ROLES = ("orl", "llada2.1", "llada2.0")
# Settings of the LLaDA2.1 rule only: the LLaDA2.0 threshold rule has no edits.
JOINT_ONLY = ("edit_threshold", "max_refine_steps")


# Temperatures below this decode greedily (vLLM's sampling epsilon): dividing logits by less
# overflows fp32 and sampling is argmax to within rounding anyway.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0  # as the server's; far past it every token is equally likely


@dataclass(frozen=True)
class DecodeConfig:
    """How one request is decoded.

    `algorithm`: "joint" = LLaDA2.1 joint threshold (mask-to-token commit + token-to-token
    edits), "threshold" = LLaDA2.0 threshold decoding with a per-step quota.
    `edit_threshold=None` disables token-to-token edits; a number means a strict `p > edit`.
    """

    algorithm: Algorithm = "joint"
    threshold: float = 0.85
    edit_threshold: float | None = 0.5
    max_refine_steps: int = 16
    steps: int = 32
    block_length: int = 32
    max_new_tokens: int = 4096
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    num_to_transfer: int = 1
    self_conditioning: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ("joint", "threshold"):
            raise ConfigError(f"algorithm must be 'joint' or 'threshold', got {self.algorithm!r}")
        _check(_is_number(self.threshold) and 0.0 <= self.threshold <= 1.0, "threshold",
               "a number in [0, 1]", self.threshold)
        if self.edit_threshold is not None:
            _check(
                _is_number(self.edit_threshold) and 0.0 <= self.edit_threshold <= 1.0,
                "edit_threshold",
                "a number in [0, 1] or None (no edits)",
                self.edit_threshold,
            )
        _check(
            _is_int(self.max_refine_steps) and self.max_refine_steps >= 0,
            "max_refine_steps",
            "an integer >= 0",
            self.max_refine_steps,
        )
        _check(_is_int(self.steps) and self.steps >= 1, "steps", "an integer >= 1", self.steps)
        _check(
            _is_int(self.block_length) and 1 <= self.block_length <= 4096,
            "block_length",
            "an integer in 1..4096",
            self.block_length,
        )
        _check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an integer >= 1",
            self.max_new_tokens,
        )
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", f"a number in [0, {MAX_TEMPERATURE:g}]", self.temperature)
        if self.temperature < MIN_TEMPERATURE:  # logits / 1e-300 overflow: greedy, as vLLM
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k is not None:
            _check(_is_int(self.top_k) and self.top_k >= 1, "top_k", "an integer >= 1", self.top_k)
        if self.top_p is not None:
            _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
                   "a number in (0, 1]", self.top_p)
        check_seed(self.seed)
        _check(
            _is_int(self.num_to_transfer) and self.num_to_transfer >= 1,
            "num_to_transfer",
            "an integer >= 1",
            self.num_to_transfer,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_seed(seed: Any) -> None:
    """A request's seed: None, or an integer a torch generator takes (0 .. 2**63 - 1)."""
    if seed is not None:
        _check(_is_int(seed) and 0 <= seed < 2**63, "seed", "an integer in [0, 2**63 - 1]",
               seed)


def _check(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"decoding option `{field}`: expected {expected}, got {value!r}")


def role_defaults(role: str) -> DecodeConfig:
    """Reference defaults of a decoder role (docs/llada2.md §5.3, §5.4, §6)."""
    if role == "orl":
        return DecodeConfig(
            "joint", 0.85, 0.5, 16, block_length=32, max_new_tokens=4096, self_conditioning=True
        )
    if role == "llada2.1":
        return DecodeConfig("joint", 0.95, 0.9, 16, block_length=32, max_new_tokens=2048)
    if role == "llada2.0":
        return DecodeConfig(
            "threshold", 0.95, None, 0, steps=32, block_length=32, max_new_tokens=2048
        )
    raise ConfigError(f"role {role!r} is not known; expected one of {', '.join(ROLES)}")


def resolve_decode_config(
    role: str, checkpoint: Path | None, overrides: dict[str, Any]
) -> DecodeConfig:
    """Role defaults, then the checkpoint's paper_decoding.json, then explicit overrides.

    The file describes the checkpoint, so it applies under every role (docs/llada2.md §6), except
    its LLaDA2.1-only settings (`JOINT_ONLY`) under the LLaDA2.0 threshold rule. In
    `overrides`, a key absent means "not given"; `edit_threshold=None` given explicitly
    disables edits.
    """
    config = role_defaults(role)
    if checkpoint is not None:
        found = read_paper_decoding(checkpoint / "paper_decoding.json", config)
        if config.algorithm == "threshold":
            found = {k: v for k, v in found.items() if k not in JOINT_ONLY}
        config = replace(config, **found)
    try:
        return replace(config, **overrides)
    except TypeError as exc:
        raise ConfigError(f"unknown decoding option: {exc}") from None
