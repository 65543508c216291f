"""Stop sequences over a byte-level "tokenizer" (an id is a byte): the text sent, the cut,
the ids kept, and what is held back, against the plain definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.engine.stop_sequences import AnswerText, checked_stops
from dlmc.errors import ConfigError


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def run(blocks: list[str], stops: tuple[str, ...]) -> tuple[AnswerText, list[tuple]]:
    answer = AnswerText(decode, stops)
    sent = [answer.add(ids_of(block)) for block in blocks]
    return answer, [*sent, ((), answer.flush())]


def test_without_stops_every_block_sends_its_text() -> None:
    answer, sent = run(["Hello", ", wor", "ld"], ())
    assert [text for _, text in sent] == ["Hello", ", wor", "ld", ""]
    assert answer.stop is None and answer.text == "Hello, world"


def test_a_stop_inside_a_block_cuts_the_text_and_the_ids() -> None:
    answer, sent = run(["The answer", " is 42.\nNext", " line"], ("\n",))
    assert [text for _, text in sent] == ["The answer", " is 42.", "", ""]
    assert answer.stop == "\n" and answer.text == "The answer is 42."
    assert answer.ids == ids_of("The answer is 42.\n")  # ends with the id completing the stop
    assert sent[1][0] == tuple(ids_of(" is 42.\n")) and sent[2][0] == ()


def test_text_that_may_begin_a_stop_waits_for_the_next_block() -> None:
    answer, sent = run(["one ST", "OP two"], ("STOP",))
    assert [text for _, text in sent] == ["one ", "", ""]
    assert answer.text == "one " and answer.ids == ids_of("one STOP")
    answer, sent = run(["one ST", "ART two"], ("STOP",))
    assert [text for _, text in sent] == ["one ", "START two", ""]
    answer, sent = run(["ends with S"], ("STOP",))
    assert [text for _, text in sent] == ["ends with ", "S"]  # flushed at the end
    assert answer.stop is None


def test_the_stop_complete_first_wins_and_a_split_character_is_whole() -> None:
    answer, _ = run(["b then a"], ("a", "b"))
    assert answer.stop == "b" and answer.text == ""
    # "a" is complete before "\naa", which began earlier: the cut is the same however the
    # text falls into blocks
    for blocks in (["\naa"], ["\na", "a"], ["\n", "aa"]):
        answer, sent = run(blocks, ("a", "\naa"))
        assert answer.stop == "a" and answer.text == "\n", blocks
        assert "".join(text for _, text in sent) == "\n" and answer.ids == ids_of("\na")
    answer, _ = run(["xab"], ("b", "ab"))  # two ending together: the longer
    assert answer.stop == "ab" and answer.text == "x"
    ids = ids_of("café!")  # é is two bytes; the block boundary splits it
    answer = AnswerText(decode, ("é",))
    assert answer.add(ids[:4]) == (tuple(ids[:4]), "caf")
    assert answer.add(ids[4:]) == ((ids[4],), "")
    assert answer.stop == "é" and answer.ids == ids[:5]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\né", max_size=40),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    stops=st.lists(st.text(alphabet="ab\né", min_size=1, max_size=3), max_size=3),
)
def test_matches_the_plain_definition(text: str, cuts: list[int], stops: list[str]) -> None:
    ids = ids_of(text)
    bounds = [0, *sorted(min(c, len(ids)) for c in cuts), len(ids)]
    answer = AnswerText(decode, checked_stops(stops))
    sent = "".join(answer.add(ids[a:b])[1] for a, b in zip(bounds, bounds[1:], strict=False))
    sent += answer.flush()
    # the plain definition: the stop whose first occurrence ends first; of two, the longer
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        assert answer.stop is None and sent == text and answer.ids == ids
        return
    end, _, stop = min(hits)
    assert answer.stop == stop
    assert sent == text[: end - len(stop)] == answer.text
    assert answer.ids == ids_of(text[:end])  # the fewest ids through it


def test_bad_stop_values_are_named() -> None:
    assert checked_stops(None) == () and checked_stops(["a", "a", "b"]) == ("a", "b")
    assert checked_stops("x") == ("x",)
    with pytest.raises(ConfigError, match="stop: a stop sequence must not be empty"):
        checked_stops(["a", ""])
    with pytest.raises(ConfigError, match="stop: expected a string or a list of strings"):
        checked_stops(["a", 3])
    with pytest.raises(ConfigError, match="stop: expected a string or a list of strings"):
        checked_stops(5)
