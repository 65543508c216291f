"""Kernel switches read from the environment (`DLMC_*`), checked once where they are read."""

from __future__ import annotations

import os

from dlmc.errors import ConfigError

__all__ = ["env_choice"]


def env_choice(env: str, default: str, allowed: tuple[str, ...]) -> str:
    """A kernel switch from the environment: `env`'s value (or `default`), one of `allowed`, else
    a `ConfigError` naming the variable. Read once per module at construction, never inside a
    compiled forward."""
    choice = os.environ.get(env, default)
    if choice not in allowed:
        raise ConfigError(f"{env}={choice!r}: expected one of {', '.join(allowed)}")
    return choice
