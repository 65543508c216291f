"""Bad input is a 4xx naming the field; an internal error is a 500; the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.serve.conftest import CHAT, FlakyLLM, health, sse_data

LONG_PROMPT = "x" * 5000  # the tiny tokenizer is byte-level: 5000 tokens > the 4096 context

# (path, body as sent, the field the error must name)
CASES = [
    ("/generate", '{"prompt": ', "body"),
    ("/generate", "[1, 2]", "body"),
    ("/generate", "", "body"),
    ("/generate", {"prompt": "a", "max_tokens": 5}, "max_tokens"),
    ("/generate", {"prompt": "a", "max_new_tokens": "ten"}, "max_new_tokens"),
    ("/generate", {"prompt": "a", "max_new_tokens": 2.5}, "max_new_tokens"),
    ("/generate", {"messages": "hi"}, "messages"),
    ("/generate", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/generate", {"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
    ("/generate", {"prompt": "a", "threshold": 1.5}, "threshold"),
    ("/generate", {"prompt": "a", "edit_threshold": -0.1}, "edit_threshold"),
    ("/generate", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/generate", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/generate", {"prompt": "a", "seed": -1}, "seed"),
    ("/generate", {"prompt": "a", "t_min": 0.3}, "t_min"),  # DiffusionGemma's, not LLaDA2's
    ("/generate", {"prompt": "a", "max_denoising_steps": 0}, "max_denoising_steps"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
    ("/generate", {"messages": []}, "messages"),
    ("/generate", {"prompt": ""}, "prompt"),
    ("/generate", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/generate", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/generate", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages[0].x"),
    ("/generate", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/generate", {"max_new_tokens": 5}, "messages"),
    ("/generate", {"prompt": LONG_PROMPT, "max_new_tokens": 8}, "prompt"),
    ("/generate", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("/generate", {"prompt": "a", "max_new_tokens": 4096}, "max_new_tokens"),
    ("/v1/chat/completions", '{"messages": [}', "body"),
    ("/v1/chat/completions", {"model": "tiny-llada2"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 129}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["\n", ""]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", 3]}, "stop"),
    ("/generate", {"prompt": "a", "stop": {"x": 1}}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "a", "logprobs": 5}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": ["a", LONG_PROMPT]}, "prompt[1]"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_completion_tokens": 5000}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES)
def test_bad_input_is_a_400_naming_the_field(
    client: httpx.Client, path: str, body: Any, param: str
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"{param}:"), error["message"]


def test_the_server_keeps_serving_after_bad_input(client: httpx.Client) -> None:
    for path, body, _ in CASES[:5]:
        client.post(path, content=body if isinstance(body, str) else json.dumps(body))
    response = client.post("/generate", json={"prompt": "a", "max_new_tokens": 8, "stream": False})
    assert response.status_code == 200 and response.json()["tokens"] == 8
    assert health(client)["queue"] == {"running": 0, "waiting": 0, "queue_size": 16}


def test_unknown_paths_and_methods_answer_json(client: httpx.Client) -> None:
    response = client.get("/nope")
    assert response.status_code == 404 and "/nope" in response.json()["error"]["message"]
    response = client.get("/generate")
    assert response.status_code == 405 and "GET /generate" in response.json()["error"]["message"]


def test_an_internal_error_is_a_500_and_the_server_goes_on(
    client: httpx.Client, flaky_llm: FlakyLLM
) -> None:
    failed = health(client)["requests"]["failed"]
    flaky_llm.fail_next = True
    response = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error"
    assert "RuntimeError: injected failure" in error["message"]

    flaky_llm.fail_next = True  # after the stream started: an error event ends it
    with client.stream("POST", "/generate", json={"prompt": "a", "max_new_tokens": 8}) as r:
        assert r.status_code == 200
        events = list(sse_data(r))
    assert events == [
        {
            "type": "error",
            "error": {
                "message": "internal error: RuntimeError: injected failure",
                "type": "internal_error",
                "param": None,
                "code": None,
            },
        }
    ]
    response = client.post("/generate", json={"prompt": "a", "max_new_tokens": 8, "stream": False})
    assert response.status_code == 200 and response.json()["tokens"] == 8
    assert health(client)["requests"]["failed"] == failed + 2

