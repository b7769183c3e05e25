"""Chat template rendering: the checkpoint's Jinja template (or the tiny model's default) in a sandbox.

Only the template shipped with the model is ever compiled; it runs in jinja2's ImmutableSandboxedEnvironment
(no attribute access to internals, no mutation of the passed objects). Templates get what HF templates expect:
`messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception(msg)`, `strftime_now(fmt)` and a
`tojson` filter that keeps non-ASCII text. The rendered text is encoded with `encode_chat` (the template writes its
own BOS). `LLM.chat`, `nanocp generate --chat` and /v1/chat/completions all render through this class.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import TINY_CHAT_TEMPLATE, Tokenizer


class ChatTemplateError(ValueError):
    """The model's template could not be compiled (a configuration problem of the checkpoint)."""


class ChatRenderError(ValueError):
    """The template refused or failed on the messages (a problem of the request)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None) -> None:
        """source: the tokenizer's chat_template (None -> the tiny default)."""
        self.source = source if source is not None else TINY_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages [{"role", "content"}] -> prompt text; ChatRenderError when the template rejects them."""
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as e:
            raise ChatRenderError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError) as e:
            raise ChatRenderError(f"chat template failed on the messages: {e}") from e
