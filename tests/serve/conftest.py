"""A real dlmc server on loopback (uvicorn in a background thread) around the tiny model, and
helpers to talk to it with httpx."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from dlmc.server import ServerSettings, create_app

LONG = 4000  # max_new_tokens of a request that keeps the engine busy for seconds
CHAT = [{"role": "user", "content": "Hi!"}]


class FlakyLLM:
    """The tiny LLM, with a switch that makes its next decode raise (an internal error)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.fail_next = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        return self._llm.stream(*args, **kwargs)


class GatedLLM:
    """The tiny LLM, recording every `stream` call the engine makes, and holding the encoding
    of any prompt that contains `HOLD` until `release` is set (`held` says one is waiting)."""

    HOLD = "<hold>"

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.held, self.release = threading.Event(), threading.Event()
        self.streamed: list[dict[str, Any]] = []  # the engine's LLM.stream arguments
        self.stream_threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def encode_prompt(self, prompt: Any = None, messages: Any = None, **kwargs: Any) -> Any:
        if self.HOLD in json.dumps([prompt, messages]):
            self.held.set()
            assert self.release.wait(60), "the held prompt was never released"
        return self._llm.encode_prompt(prompt, messages, **kwargs)

    def stream(self, **kwargs: Any) -> Any:
        self.streamed.append({k: v for k, v in kwargs.items() if k != "cancel"})
        self.stream_threads.append(threading.current_thread().name)
        return self._llm.stream(**kwargs)


@contextmanager
def running_server(llm: Any, **settings: Any) -> Iterator[str]:
    """Serve `llm` on 127.0.0.1 (a free port) until the block ends; yields the base URL."""
    app = create_app(llm, ServerSettings(model_name="tiny-llada2", **settings))
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "server did not stop"


@pytest.fixture(scope="session")
def flaky_llm(tiny_llm: Any) -> FlakyLLM:
    """The tiny model behind the fault switch, warmed up as `dlmc serve` does."""
    from dlmc.cli.serve import warm_up

    warm_up(tiny_llm, {})
    return FlakyLLM(tiny_llm)


@pytest.fixture(scope="session")
def base_url(flaky_llm: FlakyLLM) -> Iterator[str]:
    """A server with the default settings (queue of 16, timeout 600 s)."""
    with running_server(flaky_llm) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def sse_data(response: httpx.Response) -> Iterator[Any]:
    """The `data:` payloads of a server-sent event stream (JSON decoded, `[DONE]` as is)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)
        else:
            assert line == "", f"unexpected line in the event stream: {line!r}"


def health(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/health")
    assert response.status_code == 200
    return response.json()


def wait_for(client: httpx.Client, check: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /health until `check(health)` holds (or fail after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = health(client)
        if check(state):
            return state
        assert time.monotonic() < deadline, f"/health never got there: {state}"
        time.sleep(0.02)
