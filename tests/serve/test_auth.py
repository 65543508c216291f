"""`dlmc serve --api-key`: every route but /health wants `Authorization: Bearer <key>`; a
request without it or with another key is a 401; streams and their cancellation work through
the check. `--served-model-name` names the model in the answers; `--allowed-origin` adds CORS."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from dlmc.cli import main
from dlmc.errors import ConfigError
from dlmc.server import ServerSettings
from tests.serve.conftest import CHAT, LONG, FlakyLLM, health, running_server, sse_data, wait_for

KEY = "sk-test-0123"


def _refused(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert reason in error["message"] and "Authorization: Bearer" in error["message"]


def test_api_key_guards_every_route_but_health(flaky_llm: FlakyLLM) -> None:
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 8}),
        ("POST", "/generate", {"prompt": "x", "max_new_tokens": 8, "stream": False}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [5]}),
    ]
    with running_server(flaky_llm, api_key=KEY) as url, httpx.Client(base_url=url,
                                                                     timeout=60) as client:
        assert health(client)["status"] == "ok"  # open to probes
        wrong = {"Authorization": "Bearer sk-other"}
        for method, path, body in routes:
            _refused(client.request(method, path, json=body), "no Authorization header")
            _refused(client.request(method, path, json=body, headers=wrong), "a wrong API key")
            _refused(client.request(method, path, json=body, headers={"Authorization": KEY}),
                     "a wrong API key")  # the scheme is part of the header
        assert health(client)["requests"]["completed"] == 0  # nothing reached the engine
        good = {"Authorization": f"Bearer {KEY}"}
        for method, path, body in routes:
            response = client.request(method, path, json=body, headers=good)
            assert response.status_code == 200, (path, response.text)
        assert health(client)["requests"]["completed"] == 3


def test_streams_and_their_cancellation_pass_the_check(flaky_llm: FlakyLLM) -> None:
    good = {"Authorization": f"Bearer {KEY}"}
    with running_server(flaky_llm, api_key=KEY) as url, httpx.Client(
            base_url=url, timeout=60, headers=good) as client:
        body = {"messages": CHAT, "max_tokens": 24, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = list(sse_data(response))
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
        with client.stream("POST", "/generate",
                           json={"messages": CHAT, "max_new_tokens": LONG}) as response:
            assert next(sse_data(response))["type"] == "block"
        # leaving the stream cancels the request at its next round, as without a key
        wait_for(client, lambda s: s["requests"]["cancelled"] == 1 and s["queue"]["running"] == 0)


@pytest.mark.parametrize("key", ["", " padded ", "tab\there", "ключ"])
def test_bad_api_keys_are_refused_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match="api_key"):
        ServerSettings(api_key=key)


def test_serve_options_reach_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--served-model-name`, `--allowed-origin` and the key from DLMC_API_KEY reach the app
    `dlmc serve` runs."""
    import dlmc.cli.serve as serve_module

    apps: list[Any] = []
    monkeypatch.setattr(serve_module, "run_server", lambda app, *args: apps.append(app))
    monkeypatch.setattr(serve_module, "warm_up", lambda *args: None)
    monkeypatch.setenv("DLMC_API_KEY", KEY)
    args = ["serve", "-m", "tiny-llada2", "--device", "cpu", "--served-model-name", "my-dlm",
            "--allowed-origin", "http://localhost:3000"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    from starlette.testclient import TestClient

    with TestClient(apps[0]) as client:
        _refused(client.get("/v1/models"), "no Authorization header")
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert [m["id"] for m in models["data"]] == ["my-dlm"]
        probe = client.get("/health", headers={"Origin": "http://localhost:3000"})
        assert probe.json()["model"] == "my-dlm"
        assert probe.headers["access-control-allow-origin"] == "http://localhost:3000"
    monkeypatch.setenv("DLMC_API_KEY", " x")
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "api_key" in result.output and len(apps) == 1


def test_allowed_origins_get_cors_headers_and_preflights_need_no_key(flaky_llm: FlakyLLM) -> None:
    page = "http://localhost:3000"
    good = {"Authorization": f"Bearer {KEY}"}
    with running_server(flaky_llm, api_key=KEY, allowed_origins=(page,)) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == page
        assert "POST" in preflight.headers["access-control-allow-methods"]
        answer = client.get("/v1/models", headers={**good, "Origin": page})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == page
        other = client.get("/v1/models", headers={**good, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        refused = client.get("/v1/models", headers={"Origin": page})  # the key still counts
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == page
    with running_server(flaky_llm) as url:  # by default no origin is answered
        response = httpx.get(f"{url}/v1/models", headers={"Origin": page})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("origin", ["localhost:3000", "http://x.example/app", "ftp://x", ""])
def test_bad_origins_are_refused_by_name(origin: str) -> None:
    with pytest.raises(ConfigError, match="allowed_origins"):
        ServerSettings(allowed_origins=(origin,))
