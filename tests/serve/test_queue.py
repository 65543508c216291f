"""One request decodes at a time: a bounded queue (503 when full), cancellation when the
client disconnects, a request timeout, and many clients at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.serve.conftest import CHAT, LONG, FlakyLLM, health, running_server, sse_data, wait_for


def _post(url: str, path: str, body: dict[str, Any], timeout_s: float = 60) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        return client.post(path, json=body)


def test_a_full_queue_answers_503_and_the_queued_request_runs_later(flaky_llm: FlakyLLM) -> None:
    with (
        running_server(flaky_llm, queue_size=1) as url,
        httpx.Client(base_url=url, timeout=60) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        body = {"messages": CHAT, "max_new_tokens": LONG}
        with client.stream("POST", "/generate", json=body) as running:
            events = sse_data(running)  # kept: dropping the iterator would close the stream
            assert next(events)["type"] == "block"  # the engine is busy
            queued = pool.submit(
                _post, url, "/generate", {"prompt": "q", "max_new_tokens": 16, "stream": False}
            )
            wait_for(client, lambda s: s["queue"] == {"running": 1, "waiting": 1, "queue_size": 1})
            for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
                response = client.post(path, json=_body_for(path))
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["type"] == "overloaded_error" and "busy" in error["message"]
                assert response.headers["retry-after"] == "1"
        # leaving the stream disconnects it: the long request is cancelled, the queued one runs
        response = queued.result(timeout=60)
        assert response.status_code == 200 and response.json()["tokens"] == 16
        state = wait_for(client, lambda s: s["queue"]["running"] == 0)
        assert state["requests"]["rejected"] == 3 and state["requests"]["cancelled"] == 1


def _body_for(path: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"messages": CHAT, "max_tokens": 8}
    if path == "/v1/completions":
        return {"prompt": "x", "max_tokens": 8}
    return {"prompt": "x", "max_new_tokens": 8}


def test_a_client_that_disconnects_frees_the_engine(client: httpx.Client) -> None:
    before = health(client)["requests"]["cancelled"]
    body = {"messages": CHAT, "max_new_tokens": LONG}
    with client.stream("POST", "/generate", json=body) as response:
        assert next(sse_data(response))["type"] == "block"
    # the engine stops the request at its next round (it ends "cancelled", not "length")
    wait_for(
        client,
        lambda s: s["requests"]["cancelled"] == before + 1 and s["queue"]["running"] == 0,
        timeout_s=10,
    )
    response = client.post("/generate", json={"prompt": "next", "max_new_tokens": 16})
    assert response.status_code == 200
    events = list(sse_data(response))
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
    assert events[-1]["tokens"] == 16


def test_leaving_a_list_of_prompts_cancels_the_one_decoding_and_the_rest(
    client: httpx.Client,
) -> None:
    state = health(client)["requests"]
    body = {"prompt": ["x", "y", "z"], "max_tokens": LONG, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert next(sse_data(response))["choices"][0]["index"] == 0
    wait_for(client, lambda s: s["requests"]["cancelled"] == state["cancelled"] + 1
             and s["queue"]["running"] == 0, timeout_s=10)
    after = health(client)["requests"]
    assert after["completed"] == state["completed"]  # "y" and "z" never ran


def test_a_non_streaming_client_that_leaves_cancels_too(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        before = health(client)["requests"]["cancelled"]
        body = {"messages": CHAT, "max_new_tokens": LONG, "stream": False}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
            _post(base_url, "/generate", body, timeout_s=0.5)
        wait_for(
            client,
            lambda s: s["requests"]["cancelled"] == before + 1 and s["queue"]["running"] == 0,
            timeout_s=10,
        )


def test_requests_time_out_and_the_server_goes_on(flaky_llm: FlakyLLM) -> None:
    with (
        running_server(flaky_llm, request_timeout_s=2.0) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        started = time.monotonic()
        body = {"messages": CHAT, "max_new_tokens": LONG}
        response = client.post("/generate", json={**body, "stream": False})
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and "request timeout of 2 s" in error["message"]
        assert time.monotonic() - started < 10
        chat = {"messages": CHAT, "max_tokens": LONG, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            events = list(sse_data(r))
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "timeout_error"
        response = client.post("/generate", json={"prompt": "a", "max_new_tokens": 8})
        assert list(sse_data(response))[-1]["tokens"] == 8
        state = wait_for(client, lambda s: s["queue"]["running"] == 0)
        assert state["requests"]["timed_out"] == 2


def test_eight_concurrent_clients_are_all_answered(base_url: str, tiny_llm: Any) -> None:
    prompts = [f"client {i} says hello" for i in range(8)]
    want = [
        tiny_llm.generate(messages=[{"role": "user", "content": p}], max_new_tokens=24).text
        for p in prompts
    ]

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": prompts[i]}]
        with httpx.Client(base_url=base_url, timeout=120) as client:
            if i % 3 == 0:
                body = {"messages": messages, "max_new_tokens": 24}
                with client.stream("POST", "/generate", json=body) as response:
                    return list(sse_data(response))[-1]["text"]
            if i % 3 == 1:
                body = {"messages": messages, "max_new_tokens": 24, "stream": False}
                return client.post("/generate", json=body).json()["text"]
            body = {"messages": messages, "max_tokens": 24}
            data = client.post("/v1/chat/completions", json=body).json()
            return data["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8), timeout=120))
    assert got == want


class _SlowToCloseLLM:
    """A stream whose generator would go on for a second after its Done (its clean-up)."""

    def stream(self, **kwargs: Any) -> Any:
        from dlmc.results import Done, GenerateResult

        yield Done(GenerateResult(text="", token_ids=[1], prompt_token_ids=[0], num_forwards=1,
                                  total_forwards=1, tokens_per_forward=1.0, request_tps=1.0,
                                  elapsed_s=0.0, finish_reason="stop", blocks=1))
        time.sleep(1.0)


def test_the_engine_is_free_when_a_handler_sees_done() -> None:
    """The worker counts a job finished before it hands over the job's Done: a handler that
    answers on Done (and a /health right after) sees no running job."""
    import asyncio

    from dlmc.server.engine_worker import EngineWorker, Prepared

    worker = EngineWorker(_SlowToCloseLLM(), queue_size=4, request_timeout_s=10.0)
    worker.start()

    async def until_done() -> dict[str, Any]:
        async for _ in worker.events(worker.submit(Prepared([0], {}))):
            pass
        return worker.snapshot()

    try:
        state = asyncio.run(until_done())
    finally:
        worker.stop()
    assert (state["running"], state["waiting"], state["completed"]) == (0, 0, 1)


def test_a_later_part_of_an_admitted_request_is_not_refused() -> None:
    """With the queue full, a new request is refused, while the next choice or prompt of a
    request already admitted queues behind the others; the list handler submits its parts so."""
    import asyncio

    from dlmc.server.engine_worker import EngineWorker, Prepared, QueueFull
    from dlmc.server.openai_compat import _Jobs

    worker = EngineWorker(_SlowToCloseLLM(), queue_size=1, request_timeout_s=10.0)  # not started

    async def submit_all() -> tuple[dict[str, Any], list[bool]]:
        worker.submit(Prepared([0], {}))
        worker.submit(Prepared([1], {}))  # queue_size + 1 admitted: full
        with pytest.raises(QueueFull):
            worker.submit(Prepared([2], {}))
        later = worker.submit(Prepared([3], {}), admitted=True)
        assert later.request.prompt_token_ids == [3]
        seen: list[bool] = []

        class Recording:
            def submit(self, request: Prepared, admitted: bool = False) -> Any:
                seen.append(admitted)
                return worker.submit(request, admitted=admitted)

        jobs = _Jobs(Recording(), [Prepared([4], {}), Prepared([5], {})])  # type: ignore[arg-type]
        with pytest.raises(QueueFull):  # its first part is a new request
            jobs.next()
        jobs = _Jobs(Recording(), [Prepared([4], {}), Prepared([5], {})])  # type: ignore[arg-type]
        jobs.current = later  # its first part was admitted
        jobs.next()
        return worker.snapshot(), seen

    state, seen = asyncio.run(submit_all())
    assert seen == [False, True]
    assert (state["waiting"], state["rejected"]) == (4, 2)
