"""Tokenizers: a byte-level one for the embedded tiny model, a wrapper over HF `tokenizer.json` files, and (in
tiktoken_tokenizer.py) Kimi-K2's tiktoken one; `load_tokenizer` picks by the files present.

All expose the same surface: encode / decode, special token ids and strings, and the chat template as Jinja text.
One rule turns a prompt into ids everywhere (`encode_prompt`: text gets BOS as the checkpoint's
tokenizer_config.json says; `encode_chat`: a rendered chat template's text, which writes its own BOS). Rendering
the template is models/chat_template.py's job. An id past the tokenizer's vocabulary (a padded embedding's row)
decodes as empty text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .config import ModelConfig
from .tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenTokenizer
from .tokenizer_files import TokenizerError, TokenizerSettings, known_ids, with_bos_eos


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
        """Bytes -> text (invalid UTF-8 becomes U+FFFD); specials dropped, or written as their strings; ids past
        the vocabulary have no token (empty text)."""
        out, run = [], bytearray()
        for token in known_ids(ids, self.vocab_size):
            if token < 256:
                run.append(token)
                continue
            if not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(BYTE_SPECIAL_TOKENS[token - 256])
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


# ---- HF tokenizer.json -------------------------------------------------------------------------------------


@dataclass
class HFTokenizer:
    """`tokenizers.Tokenizer` from tokenizer.json, with special tokens and chat template from the checkpoint.

    add_special_tokens follows tokenizer_config.json's add_bos_token / add_eos_token when it has them, else
    tokenizer.json's post-processor (what transformers does)."""

    tokenizer: Any  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    adds_special_tokens: tuple[bool, bool] | None = None  # (BOS, EOS); None: the post-processor decides
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        # past the highest id with a token (added tokens may leave gaps, so not just their count)
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.tokenizer.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not add_special_tokens or self.adds_special_tokens is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return with_bos_eos(ids, self.bos_token_id, self.eos_token_ids, *self.adds_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids without a token (a padded vocabulary's rows past the tokenizer's) decode as empty text."""
        return self.tokenizer.decode(known_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

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
        settings = TokenizerSettings.read(directory)
        special = settings.special_tokens(tokenizer.token_to_id)
        return cls(
            tokenizer=tokenizer,
            eos_token_ids=special.eos_token_ids,
            bos_token_id=special.bos_token_id,
            pad_token_id=special.pad_token_id,
            chat_template=settings.chat_template,
            adds_special_tokens=settings.adds_special_tokens,
        )


# ---- selection and streaming -------------------------------------------------------------------------------


def load_tokenizer(model: str) -> Tokenizer:
    """ "tiny" -> ByteTokenizer; a checkpoint directory -> its tokenizer.json (HFTokenizer) or, without one, its
    tiktoken.model (Kimi-K2, Moonlight: TiktokenTokenizer)."""
    if model == "tiny":
        return ByteTokenizer(ModelConfig.tiny())
    directory = Path(model)
    if not (directory / "tokenizer.json").is_file() and (directory / TIKTOKEN_FILE).is_file():
        return TiktokenTokenizer.from_dir(directory)
    if not (directory / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{directory}: no tokenizer.json and no {TIKTOKEN_FILE} in the model directory (nanocp reads either)"
        )
    return HFTokenizer.from_dir(directory)


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """The one tokenization rule for a prompt (`LLM.generate`, `nanocp generate`, /v1/completions): text gets the
    checkpoint's special tokens (BOS as its tokenizer_config.json says); token ids are taken as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    return [int(t) for t in prompt]


def encode_chat(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """A rendered chat template's text -> ids: the template writes its own BOS, so none is added (as HF's
    apply_chat_template); special-token strings in it become their ids."""
    return tokenizer.encode(rendered, add_special_tokens=False)


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
