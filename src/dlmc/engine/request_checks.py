"""Checks of what a request hands the engine: token ids and the context limit, each refused
with a ConfigError that names the argument and what was expected."""

from __future__ import annotations

import operator
from typing import Any

import torch

from dlmc.errors import ConfigError


def checked_max_context(value: Any, positions: int) -> int:
    """`max_context` (None: the config's max_position_embeddings) as a checked int."""
    if value is None:
        return positions
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= positions:
        raise ConfigError(f"max_context={value!r}: expected an integer from 1 to the model's "
                          f"max_position_embeddings ({positions}), or None for all of them")
    return value


def checked_token_ids(values: Any, name: str, vocab_size: int,
                      allow_empty: bool = False) -> list[int]:
    """A sequence of token ids (ints, or a 1-D integer tensor) inside the vocabulary, as a
    list (empty only with `allow_empty`); anything else is a ConfigError naming the argument."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ConfigError(f"{name}: expected a 1-D integer tensor, got {values.dim()}-D "
                              f"{str(values.dtype).removeprefix('torch.')}")
        values = values.tolist()
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise ConfigError(f"{name}: expected a list of token ids, got {type(values).__name__}")
    if not len(values) and not allow_empty:
        raise ConfigError(f"{name}: expected at least one token id, got none")
    ids = []
    for value in values:
        try:
            if isinstance(value, bool):
                raise TypeError
            ids.append(operator.index(value))
        except TypeError:
            raise ConfigError(f"{name}: token ids are integers, got {value!r}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"{name}: id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    return ids
