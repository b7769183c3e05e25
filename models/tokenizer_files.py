"""What a checkpoint directory says about its tokenizer beyond the vocabulary: special tokens, whether encoding a
prompt adds BOS / EOS, and the chat template (tokenizer_config.json, config.json, generation_config.json,
chat_template.jinja). Every tokenizer kind (tokenizer.json, tiktoken.model) reads these the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """Missing or corrupt tokenizer files, or token ids that cannot be decoded."""


@dataclass(frozen=True)
class SpecialTokens:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None


@dataclass(frozen=True)
class TokenizerSettings:
    directory: Path
    tokenizer_config: dict[str, Any]
    model_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None

    @classmethod
    def read(cls, path: str | Path) -> TokenizerSettings:
        directory = Path(path)
        tok_config = _read_json(directory / "tokenizer_config.json")
        return cls(
            directory,
            tok_config,
            _read_json(directory / "config.json"),
            _read_json(directory / "generation_config.json"),
            _chat_template(directory, tok_config),
        )

    def token_text(self, key: str) -> str | None:
        """tokenizer_config's bos_token / eos_token / pad_token / unk_token as text ({"content": ...} or a string)."""
        value = self.tokenizer_config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def adds_special_tokens(self) -> tuple[bool, bool] | None:
        """(add BOS, add EOS) when encoding a prompt, as tokenizer_config.json's add_bos_token / add_eos_token say
        (one of them given: the other is False, as transformers rebuilds the post-processor); None when it says
        neither and the tokenizer's own rule applies (tokenizer.json's post-processor; nothing for tiktoken)."""
        c = self.tokenizer_config
        if c.get("add_bos_token") is None and c.get("add_eos_token") is None:
            return None
        return bool(c.get("add_bos_token")), bool(c.get("add_eos_token"))

    def special_tokens(self, token_id: Callable[[str], int | None]) -> SpecialTokens:
        """EOS ids from config.json, generation_config.json and tokenizer_config's eos_token (in that order);
        BOS from config.json's bos_token_id, else tokenizer_config's bos_token; PAD from tokenizer_config."""

        def id_of(key: str) -> int | None:
            text = self.token_text(key)
            return None if text is None else token_id(text)

        eos_ids: list[int] = []
        for source in (self.model_config.get("eos_token_id"), self.generation_config.get("eos_token_id")):
            eos_ids.extend(source if isinstance(source, list) else [] if source is None else [source])
        if (eos := id_of("eos_token")) is not None:
            eos_ids.append(eos)
        if not eos_ids:
            raise TokenizerError(
                f"{self.directory}: no eos token in config.json, generation_config.json or tokenizer files"
            )
        bos = self.model_config.get("bos_token_id")
        bos = id_of("bos_token") if bos is None else int(bos)
        if bos is None and (self.adds_special_tokens or (False, False))[0]:
            raise TokenizerError(
                f"{self.directory / 'tokenizer_config.json'}: add_bos_token is true but there is no bos token (set"
                " tokenizer_config.json's bos_token or config.json's bos_token_id)"
            )
        return SpecialTokens(
            eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos_ids)),
            bos_token_id=bos,
            pad_token_id=id_of("pad_token"),
        )


def known_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """ids without those past the tokenizer's vocabulary: they have no token (the model's embedding is padded, as
    real checkpoints' often is) and decode as empty text. A negative id is an error."""
    out = []
    for token in ids:
        token = int(token)
        if token < 0:
            raise TokenizerError(f"token id {token} is negative (token ids are in [0, vocabulary size))")
        if token < vocab_size:
            out.append(token)
    return out


def with_bos_eos(
    ids: list[int], bos_token_id: int | None, eos_token_ids: Sequence[int], add_bos: bool, add_eos: bool
) -> list[int]:
    """ids with BOS before and the first EOS after, as asked (a special token the tokenizer lacks is not added)."""
    bos = [bos_token_id] if add_bos and bos_token_id is not None else []
    eos = [eos_token_ids[0]] if add_eos and eos_token_ids else []
    return [*bos, *ids, *eos]


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
