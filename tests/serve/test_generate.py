"""`POST /generate` (streamed and not), `/health`, and how the answers match the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from dlmc.server.handling import RequestPreparer
from dlmc.server.schemas import ApiError
from tests.serve.conftest import CHAT, health, sse_data

FILLER = "x" * 4000  # the tiny tokenizer is byte-level: 4000 tokens of the 4096 context


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


def _room(llm: Any, prompt: str) -> int:
    """Answer tokens that fit after `prompt`: the context's whole blocks, less the prompt."""
    block = llm.decode_settings().block_length
    return llm.max_context // block * block - len(llm.encode_prompt(prompt))


def test_a_default_length_shrinks_to_fit_the_context(client: httpx.Client, tiny_llm: Any) -> None:
    """Without max_new_tokens the default length applies, cut to what the context holds."""
    fits = _room(tiny_llm, FILLER)
    assert 0 < fits < tiny_llm.decode_settings().max_new_tokens  # the default does not fit
    with client.stream("POST", "/generate", json={"prompt": FILLER}) as response:
        assert response.status_code == 200
        events = list(sse_data(response))
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["tokens"] == fits == sum(len(e["token_ids"]) for e in events[:-1])
    assert done["prompt_tokens"] + fits == tiny_llm.max_context


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/generate", "max_new_tokens"),
        ("/v1/completions", "max_tokens"),
        ("/v1/completions", "max_completion_tokens"),
    ],
)
def test_a_length_that_does_not_fit_is_refused_naming_the_field(
    client: httpx.Client, tiny_llm: Any, path: str, field: str
) -> None:
    fits, prompt_tokens = _room(tiny_llm, FILLER), len(tiny_llm.encode_prompt(FILLER))
    response = client.post(path, json={"prompt": FILLER, field: fits + 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"] == (
        f"{field}: {fits + 1} tokens after a prompt of {prompt_tokens} tokens exceeds the "
        f"model's context of {tiny_llm.max_context} (at most {fits} fit)"
    )


def test_what_fits_is_prepared_and_one_more_is_refused(tiny_llm: Any) -> None:
    """Checked on the request preparer alone (no decoding): the exact fit of the answer and
    of the prompt is accepted, one token more is a 400 naming the field."""
    preparer = RequestPreparer(tiny_llm, {})
    fits = _room(tiny_llm, FILLER)
    for given in (fits, None):
        prepared = preparer.prepare(prompt=FILLER, max_new_tokens=given, overrides={})
        assert prepared.settings["max_new_tokens"] == fits
        assert prepared.prompt_token_ids == tiny_llm.encode_prompt(FILLER)
    with pytest.raises(ApiError, match=rf"^max_new_tokens: .* \(at most {fits} fit\)$") as exc:
        preparer.prepare(prompt=FILLER, max_new_tokens=fits + 1, overrides={})
    assert (exc.value.status, exc.value.param) == (400, "max_new_tokens")
    context = tiny_llm.max_context
    longest = "x" * (context - 1)  # byte-level: one token a character
    assert _room(tiny_llm, longest) == 1
    assert preparer.prepare(prompt=longest, overrides={}).settings["max_new_tokens"] == 1
    with pytest.raises(ApiError, match=rf"^prompt: the prompt is {context} tokens, which leaves"):
        preparer.prepare(prompt=longest + "x", overrides={})


def test_health_reports_the_model_and_the_queue(client: httpx.Client) -> None:
    state = health(client)
    assert state["status"] == "ok" and state["model"] == "tiny-llada2"
    assert state["max_context"] == 4096
    assert state["queue"] == {"running": 0, "waiting": 0, "queue_size": 16}
    assert set(state["requests"]) == {"completed", "cancelled", "failed", "timed_out", "rejected"}
