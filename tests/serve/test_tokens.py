"""/tokenize and /detokenize: the ids a request decodes from, and their text."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serve.conftest import CHAT


def test_tokenize_gives_the_ids_a_request_decodes_from(
    client: httpx.Client, tiny_llm: Any
) -> None:
    data = client.post("/tokenize", json={"messages": CHAT}).json()
    want = tiny_llm.generate(messages=CHAT, max_new_tokens=8).prompt_token_ids
    assert data == {"tokens": want, "count": len(want), "max_model_len": 4096}
    raw = client.post("/tokenize", json={"prompt": "Hello"}).json()
    assert raw["tokens"] == tiny_llm.encode_prompt("Hello") and raw["count"] == 5
    text = client.post("/detokenize", json={"tokens": data["tokens"]}).json()["prompt"]
    assert text == tiny_llm.tokenizer.decode(want) and "Hi!" in text
    assert client.post("/detokenize", json={"tokens": raw["tokens"]}).json() == {
        "prompt": "Hello"}


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages", "give exactly one of"),
    ("/tokenize", {}, "messages", "give exactly one of"),
    ("/tokenize", {"prompt": ""}, "prompt", "must not be empty"),
    ("/detokenize", {"tokens": []}, "tokens", "must not be empty"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens", "id 99999 is outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "valid integer"),
])
def test_bad_bodies_are_named(
    client: httpx.Client, path: str, body: Any, param: str, message: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
