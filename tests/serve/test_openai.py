"""The OpenAI-compatible endpoints: chat and text completions (streamed and not), models."""

from __future__ import annotations

from typing import Any

import httpx

from tests.serve.conftest import CHAT, sse_data


def test_chat_completion(client: httpx.Client, tiny_llm: Any) -> None:
    body = {"model": "tiny-llada2", "messages": CHAT, "max_tokens": 40}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    data = response.json()
    want = tiny_llm.generate(messages=CHAT, max_new_tokens=40)
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == "tiny-llada2" and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    n_prompt = len(want.prompt_token_ids)
    assert data["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 40,
        "total_tokens": n_prompt + 40,
    }


def test_chat_completion_stream(client: httpx.Client, tiny_llm: Any) -> None:
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, *CHAT],
        "max_completion_tokens": 70,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_data(response))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    want = tiny_llm.generate(messages=body["messages"], max_new_tokens=70)
    assert text == want.text
    usage_only = chunks[-1]
    assert usage_only["choices"] == [] and usage_only["usage"]["completion_tokens"] == 70
    assert finish[0]["usage"] == usage_only["usage"]


def test_text_completion_and_its_stream(client: httpx.Client, tiny_llm: Any) -> None:
    want = tiny_llm.generate(prompt="Once upon a time", max_new_tokens=30)
    body = {"prompt": "Once upon a time", "max_tokens": 30}
    data = client.post("/v1/completions", json=body).json()
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == want.text
    assert data["usage"]["completion_tokens"] == 30
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = list(sse_data(response))
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == want.text
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["total_tokens"] == len(want.prompt_token_ids) + 30


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in data["data"]] == [
        ("tiny-llada2", "model", "dlmc")
    ]
    assert data["data"][0]["max_model_len"] == 4096  # the context, as vLLM reports it


def test_the_cap_cuts_the_block_that_crosses_the_limit_and_drops_the_rest():
    from dlmc.server.openai_compat import _Cap

    def decode(ids):
        return "".join(chr(ord("a") + i) for i in ids)

    cap = _Cap(decode, limit=5)
    assert [cap.add(ids, decode(ids)) for ids in ([0, 1, 2], [3, 4, 5, 6], [7, 8])] == \
        ["abc", "de", ""]
    assert cap.ids == [0, 1, 2, 3, 4] and cap.text == "abcde"


def test_stop_sequences_end_the_answer(client: httpx.Client, tiny_llm: Any) -> None:
    full = tiny_llm.generate(messages=CHAT, max_new_tokens=80)
    stop = full.text[45:48]
    want = tiny_llm.generate(messages=CHAT, max_new_tokens=80, stop=stop)
    assert want.text == full.text[: full.text.find(stop)] and want.stop_reason == stop
    body = {"messages": CHAT, "max_tokens": 80, "stop": [stop]}
    (choice,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["message"]["content"] == want.text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = list(sse_data(response))[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    assert chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    done = client.post("/generate", json={"messages": CHAT, "max_new_tokens": 80, "stop": stop,
                                          "stream": False}).json()
    assert (done["text"], done["finish_reason"], done["stop_reason"]) == (want.text, "stop", stop)
    # a cap below the stop: cut at max_tokens, finish "length", no stop_reason
    capped = {"messages": CHAT, "max_tokens": 8, "stop": stop}
    (choice,) = client.post("/v1/chat/completions", json=capped).json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


def test_a_list_of_prompts_is_answered_one_choice_each(
    client: httpx.Client, tiny_llm: Any
) -> None:
    prompts = ["Once upon a time", "The sky is"]
    want = [tiny_llm.generate(prompt=p, max_new_tokens=24) for p in prompts]
    body = {"prompt": prompts, "max_tokens": 24}
    data = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in data["choices"]] == [(0, want[0].text),
                                                                    (1, want[1].text)]
    n_prompt = sum(len(w.prompt_token_ids) for w in want)
    assert data["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 48,
                             "total_tokens": n_prompt + 48}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = list(sse_data(response))[:-1]
    for index, w in enumerate(want):
        mine = [c["choices"][0] for c in chunks if c["choices"] and
                c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == w.text
        assert [c["finish_reason"] for c in mine][-1] == "length"
    indexes = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert indexes == sorted(indexes)  # one prompt after the other
    assert chunks[-1]["usage"]["completion_tokens"] == 48


def test_n_choices_with_a_seed_are_each_reproducible(client: httpx.Client, tiny_llm: Any) -> None:
    sampled = {"temperature": 0.9, "seed": 7}
    want = [tiny_llm.generate(messages=CHAT, max_new_tokens=16, **{**sampled, "seed": 7 + i})
            for i in range(2)]
    assert want[0].token_ids != want[1].token_ids
    body = {"messages": CHAT, "max_tokens": 16, "n": 2, **sampled}
    data = client.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in data["choices"]] == [w.text for w in want]
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 32
    body = {"prompt": ["a", "b"], "max_tokens": 8, "n": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = list(sse_data(response))[:-1]
    ends = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert ends == [0, 1, 2, 3]


def test_the_neutral_values_clients_send_are_accepted(client: httpx.Client, tiny_llm: Any) -> None:
    want = tiny_llm.generate(messages=CHAT, max_new_tokens=8)
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False,
               "top_logprobs": 0, "logit_bias": {}, "response_format": {"type": "text"}}
    body = {"messages": CHAT, "max_tokens": 8, **neutral}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == want.text
    body = {"prompt": "a", "max_tokens": 8, "echo": False, "best_of": 1, "logprobs": None}
    assert client.post("/v1/completions", json=body).status_code == 200
    error = client.post("/v1/completions", json={**body, "best_of": 3}).json()["error"]
    assert error["message"] == "best_of: only 1: use n for several choices (got 3)"
