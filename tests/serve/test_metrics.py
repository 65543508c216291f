"""`GET /metrics` (Prometheus) and `GET /version`: the counters follow what the requests
returned, the gauges follow the queue, both routes stay open with an API key."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

import dlmc
from dlmc.server.metrics import FinishedRequest, ServerMetrics
from tests.serve.conftest import CHAT, LONG, FlakyLLM, running_server, sse_data, wait_for

NAME = "tiny-llada2"  # running_server's model name


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by (name, sorted labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": NAME, **labels}.items())))]


def test_counters_follow_the_finished_requests(flaky_llm: FlakyLLM) -> None:
    with running_server(flaky_llm) as url, httpx.Client(base_url=url, timeout=60) as client:
        before = scrape(client)
        assert value(before, "dlmc_request_success_total", finished_reason="length") == 0
        assert value(before, "dlmc_e2e_request_latency_seconds_count") == 0
        done = []
        for tokens in (8, 24):
            body = {"prompt": "count", "max_new_tokens": tokens, "stream": False, "seed": 1}
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            done.append(response.json())
        flaky_llm.fail_next = True
        assert client.post("/generate", json={"prompt": "x", "stream": False}).status_code == 500
        after = scrape(client)
    by_reason = {r: sum(d["finish_reason"] == r for d in done) for r in ("stop", "length")}
    for reason, count in by_reason.items():
        assert value(after, "dlmc_request_success_total", finished_reason=reason) == count
    assert value(after, "dlmc_prompt_tokens_total") == sum(d["prompt_tokens"] for d in done)
    assert value(after, "dlmc_generation_tokens_total") == sum(d["tokens"] for d in done)
    assert value(after, "dlmc_forwards_total") == sum(d["forwards"] for d in done)
    assert value(after, "dlmc_request_failure_total", reason="failed") == 1
    assert value(after, "dlmc_request_failure_total", reason="rejected") == 0
    for histogram in ("dlmc_e2e_request_latency_seconds", "dlmc_request_queue_time_seconds",
                      "dlmc_time_to_first_block_seconds", "dlmc_tokens_per_forward"):
        assert value(after, f"{histogram}_count") == 2, histogram
    # admission to the end holds the engine's own decode time
    assert value(after, "dlmc_e2e_request_latency_seconds_sum") >= sum(
        d["elapsed_s"] for d in done)
    assert value(after, "dlmc_tokens_per_forward_sum") == sum(
        d["tokens"] / d["forwards"] for d in done)


def test_gauges_follow_the_queue(flaky_llm: FlakyLLM) -> None:
    with running_server(flaky_llm) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"messages": CHAT, "max_new_tokens": LONG}
        with client.stream("POST", "/generate", json=body) as response:
            events = sse_data(response)  # kept: dropping the iterator would close the stream
            assert next(events)["type"] == "block"
            busy = scrape(client)
            assert value(busy, "dlmc_num_requests_running") == 1
            assert value(busy, "dlmc_num_requests_waiting") == 0
        wait_for(client, lambda s: s["queue"]["running"] == 0)
        idle = scrape(client)
    assert value(idle, "dlmc_num_requests_running") == 0
    assert value(idle, "dlmc_request_failure_total", reason="cancelled") == 1
    # a cancelled request is not a finished one
    assert value(idle, "dlmc_e2e_request_latency_seconds_count") == 0


def test_metrics_is_open_and_version_wants_the_key(flaky_llm: FlakyLLM) -> None:
    with running_server(flaky_llm, api_key="sk-test") as url, httpx.Client(
            base_url=url, timeout=60) as client:
        assert value(scrape(client), "dlmc_num_requests_running") == 0
        response = client.get("/version")
        assert response.status_code == 401  # only the probes' routes are open
        response = client.get("/version", headers={"Authorization": "Bearer sk-test"})
        assert response.json() == {"version": dlmc.__version__}


def test_a_finished_request_without_blocks_or_forwards() -> None:
    metrics = ServerMetrics("m", lambda: {"running": 0, "waiting": 2, "cancelled": 0,
                                          "failed": 0, "timed_out": 3, "rejected": 0})
    metrics.observe_finished(FinishedRequest(queued_s=0.5, first_block_s=None, total_s=0.75,
                                             prompt_tokens=7, generated_tokens=0, forwards=0,
                                             finish_reason="stop"))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]

    assert get("dlmc_num_requests_waiting") == 2
    assert get("dlmc_request_failure_total", reason="timed_out") == 3
    assert get("dlmc_request_success_total", finished_reason="stop") == 1
    assert get("dlmc_prompt_tokens_total") == 7
    assert get("dlmc_request_queue_time_seconds_sum") == 0.5
    assert get("dlmc_request_queue_time_seconds_bucket", le="0.5") == 1
    assert get("dlmc_request_queue_time_seconds_bucket", le="0.25") == 0
    assert get("dlmc_e2e_request_latency_seconds_sum") == 0.75
    assert get("dlmc_time_to_first_block_seconds_count") == 0
    assert get("dlmc_tokens_per_forward_count") == 0


def test_a_failure_to_record_metrics_is_not_the_requests(flaky_llm: FlakyLLM, monkeypatch) -> None:
    def broken(self: ServerMetrics, record: FinishedRequest) -> None:
        raise RuntimeError("metrics are broken")

    monkeypatch.setattr(ServerMetrics, "observe_finished", broken)
    with running_server(flaky_llm) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"prompt": "x", "max_new_tokens": 8, "stream": False}
        response = client.post("/generate", json=body)
        assert response.status_code == 200 and response.json()["tokens"] == 8
        state = wait_for(client, lambda s: s["queue"]["running"] == 0)
    assert state["requests"]["completed"] == 1 and state["requests"]["failed"] == 0
