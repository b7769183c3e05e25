"""Tokenizers: a byte-level one for the embedded tiny model and a wrapper over HF `tokenizer.json` files.

Both expose the same surface: encode / decode, special token ids and strings, and the chat template as Jinja text.
Rendering the template is the serving layer's job (in a sandboxed Jinja environment); render it with
`bos_token` / `eos_token` set to the tokenizer's strings and encode the result with add_special_tokens=False:
special-token strings inside the text become their ids, as with HF tokenizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .config import ModelConfig


class TokenizerError(ValueError):
    """Missing or corrupt tokenizer files, or ids outside the vocabulary."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# ---- byte tokenizer ----------------------------------------------------------------------------------------

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>")  # ids 256, 257, 258, 259

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; <|bos|> <|eos|> <|pad|> <|unk|> are 256..259 (vocab 260, the tiny model's)."""

    vocab_size = 256 + len(BYTE_SPECIAL_TOKENS)
    bos_token_id = 256
    eos_token_ids = (257,)
    pad_token_id = 258
    bos_token = BYTE_SPECIAL_TOKENS[0]
    eos_token = BYTE_SPECIAL_TOKENS[1]
    chat_template = TINY_CHAT_TEMPLATE
    _special_pattern = re.compile("(" + "|".join(re.escape(t) for t in BYTE_SPECIAL_TOKENS) + ")")

    def __init__(self, config: ModelConfig | None = None) -> None:
        if config is not None:
            self._check_matches(config)

    def _check_matches(self, config: ModelConfig) -> None:
        ours = (self.vocab_size, self.bos_token_id, self.eos_token_ids, self.pad_token_id)
        theirs = (config.vocab_size, config.bos_token_id, config.eos_token_ids, config.pad_token_id)
        if ours != theirs:
            raise TokenizerError(f"byte tokenizer (vocab, bos, eos, pad)={ours} does not match the model's {theirs}")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes; special-token strings in text become their ids; add_special_tokens prepends <|bos|>."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, piece in enumerate(self._special_pattern.split(text)):
            if i % 2:
                ids.append(256 + BYTE_SPECIAL_TOKENS.index(piece))
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Bytes -> text (invalid UTF-8 becomes U+FFFD); specials dropped, or written as their strings."""
        out, run = [], bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                run.append(token)
                continue
            if not 256 <= token < self.vocab_size:
                raise TokenizerError(f"token id {token} outside the byte vocabulary [0, {self.vocab_size})")
            if not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(BYTE_SPECIAL_TOKENS[token - 256])
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


# ---- HF tokenizer.json -------------------------------------------------------------------------------------


@dataclass
class HFTokenizer:
    """`tokenizers.Tokenizer` from tokenizer.json, with special tokens and chat template from the checkpoint."""

    tokenizer: Any  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.tokenizer.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Read tokenizer.json (+ tokenizer_config.json, chat_template.jinja, config.json, generation_config.json)."""
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: no tokenizer.json in the model directory")
        try:
            tokenizer = RustTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises plain Exception on bad files
            raise TokenizerError(f"{tokenizer_file}: cannot load tokenizer ({exc})") from exc

        tok_config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        gen_config = _read_json(directory / "generation_config.json")

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return None if text is None else tokenizer.token_to_id(text)

        eos_ids: list[int] = []
        for source in (model_config.get("eos_token_id"), gen_config.get("eos_token_id")):
            eos_ids.extend(source if isinstance(source, list) else [] if source is None else [source])
        if (eos_from_tokens := token_id(tok_config.get("eos_token"))) is not None:
            eos_ids.append(eos_from_tokens)
        if not eos_ids:
            raise TokenizerError(f"{directory}: no eos token in config.json, generation_config.json or tokenizer files")
        bos = model_config.get("bos_token_id")
        return cls(
            tokenizer=tokenizer,
            eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos_ids)),
            bos_token_id=token_id(tok_config.get("bos_token")) if bos is None else int(bos),
            pad_token_id=token_id(tok_config.get("pad_token")),
            chat_template=_chat_template(directory, tok_config),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template


# ---- selection and streaming -------------------------------------------------------------------------------


def load_tokenizer(model: str) -> ByteTokenizer | HFTokenizer:
    """ "tiny" -> ByteTokenizer; otherwise the HF tokenizer of the checkpoint directory `model`."""
    if model == "tiny":
        return ByteTokenizer(ModelConfig.tiny())
    return HFTokenizer.from_dir(model)


class StreamDecoder:
    """Incremental detokenisation: push ids one by one, get the newly completed text (never half a character)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # an incomplete UTF-8 sequence (or a merge still in flux): wait for more ids
        new, self.emitted = text[len(self.emitted) :], text
        return new

    def flush(self) -> str:
        """Whatever remains, replacement characters included."""
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return new
