"""`POST /generate` (streamed and not), `/health`, and how the answers match the engine."""

from __future__ import annotations

from typing import Any

import httpx

from tests.serve.conftest import CHAT, health, sse_data


def test_generate_streams_blocks_then_done(client: httpx.Client, tiny_llm: Any) -> None:
    body = {"messages": CHAT, "max_new_tokens": 80}
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_data(response))
    blocks, done = events[:-1], events[-1]
    assert blocks and all(e["type"] == "block" for e in blocks)
    assert [e["block_index"] for e in blocks] == sorted({e["block_index"] for e in blocks})
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["tokens"] == 80 == sum(len(e["token_ids"]) for e in blocks)
    assert "".join(e["text"] for e in blocks) == done["text"]
    assert done["forwards"] >= 1 and done["total_forwards"] >= done["forwards"]
    assert abs(done["tokens_per_forward"] - 80 / done["forwards"]) < 1e-9
    assert done["tokens_per_second"] > 0 and done["blocks"] == len(blocks)
    want = tiny_llm.generate(messages=CHAT, max_new_tokens=80)
    assert done["text"] == want.text and done["prompt_tokens"] == len(want.prompt_token_ids)


def test_generate_without_stream_is_one_object(client: httpx.Client, tiny_llm: Any) -> None:
    body = {"prompt": "The sky is", "max_new_tokens": 20, "stream": False, "threshold": 0.9}
    response = client.post("/generate", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    done = response.json()
    want = tiny_llm.generate(prompt="The sky is", max_new_tokens=20, threshold=0.9)
    assert done["type"] == "done" and done["text"] == want.text and done["tokens"] == 20


def test_curl_style_body_without_json_content_type(client: httpx.Client) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: the body is JSON anyway."""
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    content = '{"messages": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 40}'
    with client.stream("POST", "/generate", content=content, headers=headers) as response:
        assert response.status_code == 200
        events = list(sse_data(response))
    assert events[-1]["type"] == "done" and events[-1]["tokens"] == 40


def test_decoding_fields_reach_the_engine(client: httpx.Client, tiny_llm: Any) -> None:
    body = {
        "prompt": "abc",
        "max_new_tokens": 24,
        "temperature": 0.8,
        "seed": 7,
        "edit_threshold": None,
        "top_k": 5,
        "top_p": 0.9,
        "stream": False,
    }
    got = client.post("/generate", json=body).json()
    kwargs = {k: v for k, v in body.items() if k not in ("prompt", "stream")}
    want = tiny_llm.generate(prompt="abc", **kwargs)
    assert got["text"] == want.text


def test_a_default_length_shrinks_to_fit_the_context(client: httpx.Client) -> None:
    """Without max_new_tokens the role default (4096) applies, cut to what the context holds."""
    with client.stream("POST", "/generate", json={"prompt": "x" * 4000}) as response:
        assert response.status_code == 200
        events = list(sse_data(response))
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] in ("length", "stop")
    assert events[-1]["tokens"] <= 96


def test_health_reports_the_model_and_the_queue(client: httpx.Client) -> None:
    state = health(client)
    assert state["status"] == "ok" and state["model"] == "tiny-llada2"
    assert state["max_context"] == 4096
    assert state["queue"] == {"running": 0, "waiting": 0, "queue_size": 16}
    assert set(state["requests"]) == {"completed", "cancelled", "failed", "timed_out", "rejected"}
