"""The server around a DiffusionGemma model: a BlockChunk event per canvas, the OpenAI
endpoint, and LLaDA2's options or images refused as 400s naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serve.conftest import CHAT, running_server, sse_data

DEFAULTS = {"max_denoising_steps": 4}  # server-wide sampler default (the released 48 is slow)


@pytest.fixture(scope="module")
def gemma_client(tiny_gemma_llm: Any):
    with running_server(tiny_gemma_llm, decode_defaults=DEFAULTS) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        yield client


def test_generate_streams_a_block_per_canvas(gemma_client: httpx.Client, tiny_gemma_llm: Any):
    body = {"messages": CHAT, "max_new_tokens": 64, "seed": 11}
    with gemma_client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = list(sse_data(response))
    blocks, done = events[:-1], events[-1]
    want = tiny_gemma_llm.generate(messages=CHAT, max_new_tokens=64, seed=11, **DEFAULTS)
    assert done["type"] == "done" and done["text"] == want.text
    assert [e["block_index"] for e in blocks] == list(range(want.blocks))
    assert sum((e["token_ids"] for e in blocks), []) == want.token_ids
    assert done["tokens_per_forward"] == pytest.approx(want.tokens_per_forward)
    assert done["forwards"] == want.num_forwards <= 4 * want.blocks


def test_chat_completions(gemma_client: httpx.Client, tiny_gemma_llm: Any):
    body = {"messages": CHAT, "max_tokens": 32, "seed": 2}
    response = gemma_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    want = tiny_gemma_llm.generate(messages=CHAT, max_new_tokens=32, seed=2, **DEFAULTS)
    assert response.json()["choices"][0]["message"]["content"] == want.text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_max_tokens_is_a_hard_cap(gemma_client: httpx.Client, tiny_gemma_llm: Any,
                                         stream: bool):
    """40 tokens: the engine decodes two 32-token canvases (64 tokens, as transformers does);
    the OpenAI endpoint sends the first 40 and says "length"."""
    seed, want = next((s, r) for s in range(4, 64) if len((r := tiny_gemma_llm.generate(
        messages=CHAT, max_new_tokens=40, seed=s, **DEFAULTS)).token_ids) == 64)
    # with that seed the canvases pass the limit (no EOS in them)
    body = {"messages": CHAT, "max_tokens": 40, "seed": seed, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    text = tiny_gemma_llm.decode_text(want.token_ids[:40])
    if stream:
        with gemma_client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = [c for c in sse_data(response) if c != "[DONE]"]
        sent = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        usage = chunks[-1]["usage"]
    else:
        answer = gemma_client.post("/v1/chat/completions", json=body).json()
        sent, usage = answer["choices"][0]["message"]["content"], answer["usage"]
        finish = answer["choices"][0]["finish_reason"]
    assert sent == text and finish == "length"
    assert usage["completion_tokens"] == 40
    assert usage["total_tokens"] == 40 + len(want.prompt_token_ids)


def test_a_requests_sampler_settings_win(gemma_client: httpx.Client, tiny_gemma_llm: Any):
    body = {"prompt": "Hi", "max_new_tokens": 32, "seed": 5, "max_denoising_steps": 2,
            "t_min": 0.2, "t_max": 0.6, "entropy_bound": 0.3, "stability_threshold": 0,
            "confidence_threshold": 0.01, "stream": False}
    got = gemma_client.post("/generate", json=body).json()
    kwargs = {k: v for k, v in body.items() if k not in ("prompt", "stream")}
    want = tiny_gemma_llm.generate(prompt="Hi", **kwargs)
    assert got["text"] == want.text and got["forwards"] == want.num_forwards <= 2
    settings = tiny_gemma_llm.decode_settings(**kwargs).settings
    assert (settings.t_min, settings.entropy_bound, settings.stability_threshold) == (0.2, 0.3, 0)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": CHAT, "threshold": 0.9}, "threshold", "a LLaDA2 setting"),
    ({"messages": CHAT, "temperature": 0.7}, "temperature", "a LLaDA2 setting"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                {"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content[1]", "a 'image_url' part; only text parts are supported"),
])
def test_what_does_not_apply_is_a_400(gemma_client: httpx.Client, body, param, message):
    response = gemma_client.post("/generate", json={**body, "stream": False})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
