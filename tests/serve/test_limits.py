"""Request size and isolation: a body over `max_body_bytes` is a 413 naming the limit, answered
before the rest of the body is read; a request that is slow or bad to prepare neither holds the
others nor reaches the engine."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from dlmc.errors import ConfigError
from dlmc.server import ServerSettings
from dlmc.server.engine_worker import Prepared
from tests.serve.conftest import CHAT, GatedLLM, health, running_server
from tests.serve.test_bad_input import CASES

LIMIT = 8192  # max_body_bytes of this module's server
PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def gated(tiny_llm: Any) -> GatedLLM:
    return GatedLLM(tiny_llm)


@pytest.fixture(scope="module")
def url(gated: GatedLLM) -> Iterator[str]:
    with running_server(gated, max_body_bytes=LIMIT) as base:
        yield base


def _small(path: str, tokens: int = 4) -> dict[str, Any]:
    """A valid non-streaming request for `tokens` tokens."""
    if path == "/v1/chat/completions":
        return {"messages": CHAT, "max_tokens": tokens}
    if path == "/v1/completions":
        return {"prompt": "a", "max_tokens": tokens}
    return {"prompt": "a", "max_new_tokens": tokens, "stream": False}


def _tokens(path: str, answer: dict[str, Any]) -> int:
    return answer["tokens"] if path == "/generate" else answer["usage"]["completion_tokens"]


def _padded(body: dict[str, Any], size: int) -> bytes:
    """`body` as JSON of exactly `size` bytes (padded with spaces, which JSON ignores)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def _chunked(raw: bytes) -> Iterator[bytes]:
    """`raw` as an iterator: httpx then sends it chunked, without a Content-Length."""
    for start in range(0, len(raw), 1000):
        yield raw[start : start + 1000]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", PATHS)
def test_a_body_over_the_limit_is_a_413_naming_it(url: str, path: str, chunked: bool) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        over = _padded(_small(path), LIMIT + 1)
        response = client.post(path, content=_chunked(over) if chunked else over)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "body"
        assert error["message"].startswith("body: ")
        assert f"the server's limit of {LIMIT} bytes (dlmc serve --max-body-bytes)" in (
            error["message"]
        )
        assert ("Content-Length 8193" in error["message"]) is not chunked
        at_limit = _padded(_small(path), LIMIT)
        response = client.post(path, content=_chunked(at_limit) if chunked else at_limit)
        assert response.status_code == 200, response.text
        assert _tokens(path, response.json()) == 4


def _unfinished_post(url: str, path: str, header: str, body_start: bytes) -> tuple[int, str]:
    """POST a head and the start of a body that never ends; return the status and error
    message (a server that waited for the rest would time out here)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {where.hostname}\r\n{header}\r\n\r\n"
        sock.sendall(head.encode() + body_start)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
def test_the_limit_holds_before_the_body_has_arrived(url: str, path: str) -> None:
    declared = 10**9  # 10 bytes of it are sent: the header alone decides
    status, message = _unfinished_post(url, path, f"Content-Length: {declared}", b'{"prompt":')
    assert status == 413
    assert message == (
        f"body: Content-Length {declared} exceeds the server's limit of {LIMIT} bytes "
        "(dlmc serve --max-body-bytes)"
    )
    chunk = b" " * (LIMIT + 1)  # one chunk past the limit, and no last chunk
    status, message = _unfinished_post(
        url, path, "Transfer-Encoding: chunked", b"%x\r\n%s\r\n" % (len(chunk), chunk)
    )
    assert status == 413
    assert message == (
        f"body: larger than the server's limit of {LIMIT} bytes (dlmc serve --max-body-bytes)"
    )


def test_the_default_limit_is_one_mib(client: httpx.Client) -> None:
    limit = ServerSettings().max_body_bytes
    assert limit == 1024 * 1024
    response = client.post("/generate", content=_padded(_small("/generate"), limit + 1))
    assert response.status_code == 413
    assert f"limit of {limit} bytes" in response.json()["error"]["message"]
    response = client.post("/generate", content=_padded(_small("/generate"), limit))
    assert response.status_code == 200 and response.json()["tokens"] == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1024"])
def test_max_body_bytes_is_checked(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"^max_body_bytes: expected an integer >= 1, got "):
        ServerSettings(max_body_bytes=bad)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.post(path, json=body)


def test_a_request_held_in_preparation_does_not_hold_the_others(
    url: str, gated: GatedLLM
) -> None:
    """The big request's encoding waits on an event that is set only after the small requests
    were answered: they could not have been if the event loop, a lock shared by the
    encodings, or the engine thread waited for it (they would time out instead)."""
    gated.held.clear()
    gated.release.clear()
    gated.streamed.clear()
    gated.stream_threads.clear()
    # too long for the 4096-token context: a 400 once it is encoded
    big = {"prompt": GatedLLM.HOLD + "x" * 5000, "max_new_tokens": 8, "stream": False}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=30) as client:
        try:
            pending = pool.submit(_post, url, "/generate", big)
            assert gated.held.wait(30), "the big request never reached its encoding"
            for path in PATHS:
                response = client.post(path, json=_small(path))
                assert response.status_code == 200, response.text
                assert _tokens(path, response.json()) == 4
            assert not pending.done()  # the big one is still held
            assert health(client)["queue"] == {"running": 0, "waiting": 0, "queue_size": 16}
        finally:
            gated.release.set()
        response = pending.result(timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert len(gated.streamed) == 3 and set(gated.stream_threads) == {"dlmc-engine"}


def test_the_engine_sees_only_prepared_requests(url: str, gated: GatedLLM) -> None:
    gated.streamed.clear()
    with httpx.Client(base_url=url, timeout=60) as client:
        for path, body, _ in CASES:
            content = body if isinstance(body, str) else json.dumps(body)
            assert client.post(path, content=content).status_code == 400
        for path in PATHS:
            assert client.post(path, content=_padded(_small(path), LIMIT + 1)).status_code == 413
        assert gated.streamed == []
        body = {"prompt": "The sky", "max_tokens": 4, "temperature": 0.5, "seed": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
    (call,) = gated.streamed
    assert call["prompt_token_ids"] == gated.encode_prompt("The sky")
    assert (call["max_new_tokens"], call["temperature"], call["seed"]) == (4, 0.5, 3)
    assert not {"prompt", "messages"} & set(call)


def test_a_prepared_request_carries_no_text() -> None:
    with pytest.raises(ValueError, match=r"^settings: \['prompt'\] belong in prompt_token_ids"):
        Prepared([1, 2], {"prompt": "a", "max_new_tokens": 4})
    prepared = Prepared([1, 2], {"max_new_tokens": 4})
    assert prepared.stream_kwargs() == {"max_new_tokens": 4, "prompt_token_ids": [1, 2]}
