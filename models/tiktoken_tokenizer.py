"""Kimi-K2's tokenizer (also Moonlight's): a tiktoken BPE over `tiktoken.model`, without a tokenizer.json.

It reads the checkpoint as the checkpoint's own remote code (`tokenization_kimi.TikTokenTokenizer`) does:

- `tiktoken.model`: one `<base64 token> <rank>` per line (tiktoken's `load_tiktoken_bpe` format), the base
  vocabulary of n tokens with ranks 0..n-1;
- 256 special tokens after it (ids n..n+255): named by tokenizer_config.json's `added_tokens_decoder`, the others
  `<|reserved_token_{id}|>`; special-token strings in a text encode as their ids;
- the pre-tokenization regex below (it lives in that code, not in any file of the checkpoint), and text split
  into pieces of at most 400,000 characters and 25,000 consecutive (non-)whitespace characters before BPE;
- decoding: the tokens' bytes as UTF-8 (invalid bytes become U+FFFD), special tokens dropped when skipped.

BOS / EOS are added to an encoded prompt only where tokenizer_config.json's add_bos_token / add_eos_token say so
(the code adds none itself).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tokenizer_files import TokenizerError, TokenizerSettings, known_ids, with_bos_eos

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256
# tokenization_kimi.py's `pat_str`: o200k-style words with Han runs split off, numbers in 1-3 digits.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# The remote code this reading follows (tokenizer_config.json's auto_map.AutoTokenizer).
SUPPORTED_CODE = ("tokenization_kimi.TikTokenTokenizer", "tokenization_moonshot.TikTokenTokenizer")
MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def read_tiktoken_bpe(path: Path) -> dict[bytes, int]:
    """`<base64 token> <rank>` lines -> {token bytes: rank} (tiktoken's load_tiktoken_bpe, read directly: its
    cache would key a local file by its path)."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}:{number}: expected '<base64 token> <rank>', got {line[:60]!r}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: the ranks of its {len(ranks)} tokens are not 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte-level BPE needs all 256 single bytes; {len(missing)} are missing")
    return ranks


def split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """text in pieces none of which has more than max_run consecutive whitespace or non-whitespace characters
    (tokenization_kimi's _split_whitespaces_or_nonwhitespaces: tiktoken is quadratic on long runs)."""
    run, is_space, start = 0, text[0].isspace() if text else False, 0
    for i, char in enumerate(text):
        if is_space != char.isspace():
            run, is_space = 1, char.isspace()
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


@dataclass
class TiktokenTokenizer:
    encoding: Any  # tiktoken.Encoding
    special_tokens: dict[str, int]  # name -> id
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    adds_special_tokens: tuple[bool, bool] | None = None  # (BOS, EOS) from tokenizer_config; None: add nothing
    vocab_size: int = field(init=False)
    _names: dict[int, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.vocab_size = self.encoding.n_vocab
        self._names = {i: name for name, i in self.special_tokens.items()}

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else None

    def token_text(self, token_id: int) -> str:
        if token_id in self._names:
            return self._names[token_id]
        return self.encoding.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[i : i + MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
        if add_special_tokens and self.adds_special_tokens is not None:
            return with_bos_eos(ids, self.bos_token_id, self.eos_token_ids, *self.adds_special_tokens)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Tokens' bytes as UTF-8; special tokens dropped or written as their names; ids past the vocabulary have
        no token (empty text)."""
        out: list[str] = []
        run: list[int] = []
        for token in known_ids(ids, self.vocab_size):
            if token not in self._names:
                run.append(token)
            elif not skip_special_tokens:
                out.append(self.encoding.decode_bytes(run).decode("utf-8", errors="replace"))
                out.append(self._names[token])
                run = []
        out.append(self.encoding.decode_bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)

    @classmethod
    def from_dir(cls, path: str | Path) -> TiktokenTokenizer:
        """Read tiktoken.model + tokenizer_config.json (added_tokens_decoder, special tokens, chat template), with
        config.json / generation_config.json for the EOS ids."""
        import tiktoken

        directory = Path(path)
        model_file = directory / TIKTOKEN_FILE
        if not model_file.is_file():
            raise TokenizerError(f"{model_file}: no {TIKTOKEN_FILE} in the model directory")
        settings = TokenizerSettings.read(directory)
        _check_code(directory, settings.tokenizer_config)
        ranks = read_tiktoken_bpe(model_file)
        special = _special_tokens(directory, settings.tokenizer_config, len(ranks))
        encoding = tiktoken.Encoding(
            name=str(model_file), pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )

        def token_id(text: str) -> int | None:
            if text in special:
                return special[text]
            try:
                return encoding.encode_single_token(text)
            except KeyError:
                return None

        ids = settings.special_tokens(token_id)
        return cls(
            encoding=encoding,
            special_tokens=special,
            eos_token_ids=ids.eos_token_ids,
            bos_token_id=ids.bos_token_id,
            pad_token_id=ids.pad_token_id,
            chat_template=settings.chat_template,
            adds_special_tokens=settings.adds_special_tokens,
        )


def _check_code(directory: Path, tok_config: dict[str, Any]) -> None:
    auto = tok_config.get("auto_map", {}).get("AutoTokenizer") if isinstance(tok_config.get("auto_map"), dict) else None
    code = auto[0] if isinstance(auto, list) and auto else auto
    if code not in SUPPORTED_CODE:
        raise TokenizerError(
            f"{directory / 'tokenizer_config.json'}: tiktoken tokenizer code {code!r} is not one nanocp reads"
            f" (supported: auto_map.AutoTokenizer {' or '.join(SUPPORTED_CODE)}, Kimi-K2 / Moonlight); add a"
            " tokenizer.json instead"
        )


def _special_tokens(directory: Path, tok_config: dict[str, Any], num_base: int) -> dict[str, int]:
    """The 256 ids after the base vocabulary: names from added_tokens_decoder, else <|reserved_token_{id}|>."""
    decoder = tok_config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder must be an object")
    names = {}
    for key, value in decoder.items():
        content = value.get("content") if isinstance(value, dict) else None
        if not str(key).isdigit() or not isinstance(content, str):
            raise TokenizerError(
                f"{directory / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r} must map an id to"
                ' {"content": "<token>", ...}'
            )
        names[int(key)] = content
    special = {}
    for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS):
        name = names.get(i, f"<|reserved_token_{i}|>")
        if name in special:
            raise TokenizerError(f"{directory / 'tokenizer_config.json'}: special token {name!r} named twice")
        special[name] = i
    return special
