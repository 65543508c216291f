"""Request bodies of the server (pydantic, strict, unknown fields refused) and the error they
turn into: `ApiError`, sent as `{"error": {"message", "type", "param", "code"}}` like OpenAI.

Bodies are parsed from the raw bytes whatever the Content-Type, so `curl -d '{...}'` (which
sends `application/x-www-form-urlencoded`) works as well as a JSON client.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from dlmc.graphs.canvas_settings import CANVAS_KEYS


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


class _Strict(BaseModel):
    """Strict types (no "5" for 5), unknown fields refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TextPart(_Strict):
    """One part of an OpenAI message content list (only text is supported)."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """A chat turn; `developer` is treated as `system`."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part other than text (an image, audio) is refused by its index and type."""
        for index, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    "unsupported_part", "a '{kind}' part; only text parts are supported "
                    "(dlmc runs the models' text path)", {"index": index, "kind": kind})
        return content

    def as_engine_message(self) -> dict[str, str]:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class DecodeFields(_Strict):
    """Decoding fields every endpoint accepts (absent = the server's default)."""

    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    # an explicit null disables token-to-token edits
    edit_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    # DiffusionGemma's sampler (a LLaDA2 model refuses them by name)
    max_denoising_steps: int | None = Field(default=None, ge=1)
    t_min: float | None = Field(default=None, ge=0.0, le=100.0)
    t_max: float | None = Field(default=None, ge=0.0, le=100.0)
    entropy_bound: float | None = Field(default=None, gt=0.0)
    stability_threshold: int | None = Field(default=None, ge=0)
    confidence_threshold: float | None = Field(default=None, ge=0.0)
    # stop sequences: the answer ends before the first that appears
    stop: str | list[str] | None = None

    def decode_overrides(self) -> dict[str, Any]:
        """The decoding fields the request gave (`edit_threshold: null` kept: no edits)."""
        given = {
            k: getattr(self, k)
            for k in ("threshold", "temperature", "top_k", "top_p", "seed", *CANVAS_KEYS)
            if getattr(self, k) is not None
        }
        if "edit_threshold" in self.model_fields_set:
            given["edit_threshold"] = self.edit_threshold
        return given


class PromptFields(_Strict):
    """Exactly one of `messages` (rendered with the chat template) or `prompt` (raw text)."""

    messages: list[Message] | None = Field(default=None, min_length=1)
    prompt: str | None = Field(default=None, min_length=1)

    def engine_prompt(self) -> tuple[str | None, list[dict[str, str]] | None, str]:
        """(prompt, messages, the field that names the prompt in errors)."""
        if (self.messages is None) == (self.prompt is None):
            raise ApiError(400, "messages: give exactly one of messages or prompt",
                           param="messages")
        if self.messages is not None:
            return None, [m.as_engine_message() for m in self.messages], "messages"
        return self.prompt, None, "prompt"


class GenerateRequest(DecodeFields, PromptFields):
    """`POST /generate`: exactly one of `messages` or `prompt`."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    stream: bool = True


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI fields that clients send at their neutral value: that value (or null) is accepted,
# any other is a 400 that says why
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0, 0.0), "only 0: dlmc's decoders have no repetition penalties"),
    "presence_penalty": ((0, 0.0), "only 0: dlmc's decoders have no repetition penalties"),
    "logprobs": ((False, 0), "only false or 0: log probabilities are not returned"),
    "top_logprobs": ((0,), "only 0: log probabilities are not returned"),
    "echo": ((False,), "only false: the prompt is not echoed"),
    "best_of": ((1,), "only 1: use n for several choices"),
    "logit_bias": (({},), "only {}: logit biases are not supported"),
    "response_format": (({"type": "text"},), 'only {"type": "text"}: output is not constrained'),
}


class _OpenAIFields(DecodeFields):
    """Fields shared by the OpenAI endpoints. `model` is accepted and ignored (the server
    serves one model; responses name it). `n` choices per prompt decode one after another;
    with a `seed`, choice i uses seed + i, so sampled choices differ and each is
    reproducible."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)  # choices per prompt, decoded one after another
    user: str | None = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    logit_bias: Any = None
    response_format: Any = None

    @field_validator(*NEUTRAL, mode="before")
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        allowed, why = NEUTRAL[str(info.field_name)]
        if value is None or any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise PydanticCustomError("unsupported_value", why + " (got {value})", {"value": value})

    def max_new_tokens(self) -> tuple[int | None, str]:
        """The answer length limit and the name of the field that gave it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(_OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_OpenAIFields):
    """`POST /v1/completions`: a prompt, or a list of prompts (answered one after another,
    one choice each)."""

    prompt: str | list[str] = Field(min_length=1)

    def prompt_texts(self) -> list[tuple[str, str]]:
        """(prompt, the field that names it in errors) for each prompt."""
        if isinstance(self.prompt, str):
            return [(self.prompt, "prompt")]
        return [(text, f"prompt[{i}]") for i, text in enumerate(self.prompt)]


class TokenizeRequest(PromptFields):
    """`POST /tokenize`."""


class DetokenizeRequest(_Strict):
    """`POST /detokenize`."""

    tokens: list[int] = Field(min_length=1)


Request = TypeVar("Request", bound=BaseModel)


def parse_body(model: type[Request], raw: bytes) -> Request:
    """Validate a raw request body; any problem becomes a 400 ApiError naming the field."""
    if not raw.strip():
        raise ApiError(400, "body: expected a JSON object, got an empty body", param="body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _as_api_error(exc, model) from None


def _as_api_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    first = exc.errors(include_url=False)[0]
    kind, loc, msg = first["type"], first["loc"], first["msg"]
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", msg)
        return ApiError(400, f"body: invalid JSON ({reason})", param="body")
    param = _param_name(loc)
    if kind == "model_type" and not loc:
        return ApiError(400, "body: expected a JSON object", param="body")
    if kind == "extra_forbidden":
        known = f" (known fields: {', '.join(model.model_fields)})" if len(loc) == 1 else ""
        return ApiError(400, f"{param}: unknown field{known}", param=param)
    if kind == "unsupported_value":
        return ApiError(400, f"{param}: {msg}", param=param)
    if kind == "unsupported_part":
        param = f"{param}[{first['ctx']['index']}]"
        return ApiError(400, f"{param}: {msg}", param=param)
    if kind == "missing":
        return ApiError(400, f"{param}: required field is missing", param=param)
    if kind in ("too_short", "string_too_short") and first.get("ctx", {}).get("min_length") == 1:
        return ApiError(400, f"{param}: must not be empty", param=param)
    if param == "stop":  # a union: pydantic's message names one branch
        text = f"stop: expected a string or a list of strings (got {first.get('input')!r})"
        return ApiError(400, text, param="stop")
    got = first.get("input")
    shown = repr(got) if isinstance(got, str | int | float | bool) or got is None else type(got)
    if isinstance(shown, type):
        shown = {dict: "an object", list: "a list"}.get(shown, shown.__name__)
    return ApiError(400, f"{param}: {msg[0].lower()}{msg[1:]} (got {shown})", param=param)


def _param_name(loc: tuple[int | str, ...]) -> str:
    """`("messages", 0, "content")` -> `messages[0].content`; union branch names dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "float", "int", "bool", "none") or "[" in part:
            continue  # pydantic names the union member it tried; the user did not write it
        else:
            out += f".{part}" if out else part
    return out or "body"
