"""What a request hands the engine: token ids and the context limit, refused by name."""

import numpy as np
import pytest
import torch

from dlmc.engine.request_checks import checked_max_context, checked_token_ids
from dlmc.errors import ConfigError


@pytest.mark.parametrize(("token_ids", "message"), [
    ([], "expected at least one token id"),
    ([[1, 2]], r"token ids are integers, got \[1, 2\]"),
    ([3, True], "token ids are integers, got True"),
    ([3, 1.0], "token ids are integers, got 1.0"),
    ("abc", "expected a list of token ids, got str"),
    (None, "expected a list of token ids, got NoneType"),
    (torch.ones(2), "expected a 1-D integer tensor, got 1-D float32"),
    (torch.ones(1, 2, dtype=torch.long), "expected a 1-D integer tensor, got 2-D int64"),
    ([1, 99], r"id 99 is outside the vocabulary 0\.\.63"),
    ([-1], r"id -1 is outside the vocabulary 0\.\.63"),
])
def test_bad_token_ids_are_named(token_ids, message):
    with pytest.raises(ConfigError, match="^ids: " + message):
        checked_token_ids(token_ids, "ids", 64)


def test_token_ids_come_back_as_a_list_of_ints():
    want = [5, 0, 63]
    for given in (want, tuple(want), np.array(want), torch.tensor(want, dtype=torch.int32)):
        got = checked_token_ids(given, "ids", 64)
        assert got == want and all(type(t) is int for t in got)
    assert checked_token_ids([], "ids", 64, allow_empty=True) == []


def test_max_context_is_between_one_and_the_models_positions():
    assert checked_max_context(None, 4096) == 4096
    assert checked_max_context(1, 4096) == 1 and checked_max_context(4096, 4096) == 4096
    for bad in (0, -1, 4097, 2.0, True, "96"):
        with pytest.raises(ConfigError, match=rf"max_context={bad!r}: .* \(4096\)"):
            checked_max_context(bad, 4096)
