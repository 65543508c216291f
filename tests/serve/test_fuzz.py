"""Random request bodies, valid and not, on every endpoint: the answer is a 200 or a 400 that
names what is wrong, never a 500, and a stream ends with its done event (no error event)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import running_server, sse_data

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.text(max_size=6),
                st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(), max_size=2))


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` nine times in ten, anything JSON can hold otherwise."""
    return st.integers(0, 9).flatmap(lambda draw: ANY if draw == 0 else valid)


TEXT = st.text(min_size=1, max_size=24)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = mostly(st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant"])),
     "content": mostly(st.one_of(TEXT, st.lists(PART, min_size=1, max_size=2)))}))
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=3).map(
    lambda turns: [*turns, {"role": "user", "content": "hi"}]))
STOP = mostly(st.one_of(TEXT, st.lists(TEXT, max_size=3)))
DECODING = {"threshold": mostly(st.floats(0, 1)),
            "edit_threshold": mostly(st.one_of(st.none(), st.floats(0, 1))),
            "temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0.05, 1)),
            "top_k": mostly(st.integers(1, 50)), "seed": mostly(st.integers(0, 2**31)),
            "stop": STOP, "stream": mostly(st.booleans())}
LENGTH = st.integers(1, 8)  # always given and short: every valid body decodes quickly
ONE_OF_THEM = st.one_of(st.fixed_dictionaries({"prompt": mostly(TEXT)}),
                        st.fixed_dictionaries({"messages": MESSAGES}))
BOTH_OR_NEITHER = st.one_of(st.fixed_dictionaries({"prompt": TEXT, "messages": MESSAGES}),
                            st.just({}))  # a 400
PROMPT_OR_MESSAGES = st.integers(0, 9).flatmap(
    lambda draw: BOTH_OR_NEITHER if draw == 0 else ONE_OF_THEM)


def _generate_bodies(options: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """/generate bodies: a short length, some of `options`, a prompt or messages."""
    base = st.fixed_dictionaries({"max_new_tokens": LENGTH}, optional=options)
    return st.tuples(base, PROMPT_OR_MESSAGES).map(lambda parts: {**parts[0], **parts[1]})


def _bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    if path == "/generate":
        return _generate_bodies(DECODING)
    openai = {"n": mostly(st.integers(1, 2)), "model": mostly(TEXT),
              "presence_penalty": mostly(st.just(0)), "logprobs": mostly(st.just(False)),
              **DECODING}
    if path == "/v1/chat/completions":
        return st.fixed_dictionaries({"max_tokens": LENGTH, "messages": MESSAGES},
                                     optional=openai)
    prompts = mostly(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2)))
    return st.fixed_dictionaries({"max_tokens": LENGTH, "prompt": prompts}, optional=openai)


def _check(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body)  # NaN and Infinity as Python writes them: not JSON
    headers = {"Content-Type": "application/json"}
    with client.stream("POST", path, content=raw, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            assert response.status_code == 400, (path, raw, response.text)
            error = response.json()["error"]
            assert error["type"] in ("invalid_request_error", "unsupported_value"), error
            assert error["message"] and (error["param"] is None or isinstance(error["param"],
                                                                               str))
            return
        if "text/event-stream" not in response.headers["content-type"]:
            response.read()
            data = response.json()
            assert "error" not in data and (data.get("choices") or data["type"] == "done")
            return
        events = list(sse_data(response))
    assert not any(isinstance(e, dict) and e.get("type") == "error" for e in events), events
    last = events[-1]
    assert last == "[DONE]" or last["type"] == "done", last


FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(body=_bodies("/generate"))
def test_generate_never_fails_inside(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "/generate", body)


@FUZZ
@given(body=_bodies("/v1/chat/completions"))
def test_chat_completions_never_fail_inside(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "/v1/chat/completions", body)


@FUZZ
@given(body=_bodies("/v1/completions"))
def test_completions_never_fail_inside(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "/v1/completions", body)


CANVAS = {"max_denoising_steps": mostly(st.integers(1, 3)), "t_min": mostly(st.floats(0, 1)),
          "t_max": mostly(st.floats(0, 2)), "entropy_bound": mostly(st.floats(0, 5)),
          "stability_threshold": mostly(st.integers(0, 3)),
          "confidence_threshold": mostly(st.floats(0, 1)), "seed": mostly(st.integers(0, 99)),
          "stream": mostly(st.booleans()), "stop": STOP, "temperature": mostly(st.just(0.0))}


@pytest.fixture(scope="module")
def gemma_client(tiny_gemma_llm: Any) -> Iterator[httpx.Client]:
    with running_server(tiny_gemma_llm, decode_defaults={"max_denoising_steps": 2}) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        yield client


@FUZZ
@given(body=_generate_bodies(CANVAS))
def test_diffusiongemma_sampler_settings_never_fail_inside(gemma_client: httpx.Client,
                                                           body: dict[str, Any]) -> None:
    _check(gemma_client, "/generate", body)


def test_non_finite_numbers_are_refused(client: httpx.Client) -> None:
    """Python's json writes NaN / Infinity, which JSON does not have: a 400, not a crash."""
    body = {"prompt": "a", "max_new_tokens": 2, "threshold": float("nan")}
    response = client.post("/generate", content=json.dumps(body),
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]
