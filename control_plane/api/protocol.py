"""Request and response bodies of the OpenAI-compatible API (pydantic), and their checks.

Requests are validated strictly (no "10" for an int, no 1 for a bool). Unknown fields are ignored as OpenAI's
own API does, except fields that would change the answer in ways this server does not implement: those must
keep their neutral value (n = 1, no logprobs, no echo, ...) or the request is refused with a 400. A request never
carries its own chat template: `chat_template` is refused (templates come from the checkpoint only).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import bad_request, from_validation_error

MAX_STOP_SEQUENCES = 4  # OpenAI's limit


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1  # extension (vLLM): -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # extension (vLLM): keep generating past EOS (benchmarks)
    return_token_ids: bool = False  # extension (vLLM): prompt_token_ids and token_ids in a non-streamed answer
    # OpenAI fields accepted only at their neutral value
    logprobs: Any = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check(self) -> None:
        """Cross-field and unsupported-value checks (raise APIError 400)."""
        extra = self.model_extra or {}
        if "chat_template" in extra or "chat_template_kwargs" in extra:
            raise bad_request(
                "'chat_template' is not accepted in requests; the model's own template is used",
                "unsupported_parameter",
                "chat_template",
            )
        if self.n != 1:
            raise bad_request(
                f"'n' must be 1 (got {self.n}); this server returns one choice per request",
                "unsupported_parameter",
                "n",
            )
        if self.best_of not in (None, 1):
            raise bad_request("'best_of' must be 1 or absent", "unsupported_parameter", "best_of")
        if self.logprobs not in (None, False):
            raise bad_request("'logprobs' is not supported", "unsupported_parameter", "logprobs")
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            raise bad_request("frequency/presence penalties are not supported", "unsupported_parameter")
        if self.logit_bias:
            raise bad_request("'logit_bias' is not supported", "unsupported_parameter", "logit_bias")
        if self.top_k != -1 and self.top_k < 1:
            raise bad_request(f"'top_k' must be -1 (off) or >= 1, got {self.top_k}", "invalid_value", "top_k")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", "invalid_value", "stop")
        if any(not s for s in stops):
            raise bad_request("stop sequences must be non-empty strings", "invalid_value", "stop")
        if self.return_token_ids and self.stream:
            raise bad_request(
                "'return_token_ids' is supported without 'stream' only", "unsupported_parameter", "return_token_ids"
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", "invalid_value", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise bad_request("'echo' is not supported", "unsupported_parameter", "echo")
        if self.suffix:
            raise bad_request("'suffix' is not supported", "unsupported_parameter", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("'prompt' is empty", "invalid_prompt", "prompt")
        if isinstance(p[0], int):
            return p
        if len(p) != 1:
            raise bad_request(f"one prompt per request, got {len(p)}", "unsupported_parameter", "prompt")
        return p[0]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None

    def check(self) -> None:
        super().check()
        if self.tools:
            raise bad_request("'tools' is not supported", "unsupported_parameter", "tools")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise bad_request("'max_tokens' and 'max_completion_tokens' disagree", "invalid_value")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[_SamplingFields], body: bytes) -> _SamplingFields:
    """JSON bytes -> a checked request; every problem becomes an APIError 400."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    request.check()
    return request


# ---- responses -------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_body(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def with_token_ids(body: dict, prompt_token_ids: list[int], token_ids: list[int]) -> dict:
    """vLLM's return_token_ids fields: a completion's choice gets both lists; a chat answer gets prompt_token_ids
    at the top and token_ids in its choice."""
    choice = body["choices"][0]
    target = choice if body["object"] == "text_completion" else body
    target["prompt_token_ids"] = list(prompt_token_ids)
    choice["token_ids"] = list(token_ids)
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_list(model: str, max_model_len: int, created: int | None = None) -> dict:
    card = {
        "id": model,
        "object": "model",
        "created": created or int(time.time()),
        "owned_by": "nanocp",
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}
