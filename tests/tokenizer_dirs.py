"""Tokenizer files of real checkpoint kinds, built small by the tests: an HF tokenizer.json (DeepSeek-style) and
Kimi-K2's tiktoken.model + tokenizer_config.json (no tokenizer.json)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "naïve café 東京 🚀", "def f(x): return x"] * 20
KIMI_CORPUS = ["hello world, hello Kimi", "the model's answer is 42", "你好世界 你好", "def f(x):\n    return x"]
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# Kimi-K2's named specials, by offset from the base vocabulary (the others are <|reserved_token_{id}|>).
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


def write_json(path: Path, content: dict | None) -> None:
    if content is not None:
        path.write_text(json.dumps(content), encoding="utf-8")


def write_hf_tokenizer(
    directory: Path, *, vocab_size: int = 400, tokenizer_config=None, config=None, generation_config=None
) -> Path:
    """A byte-level BPE tokenizer.json (specials 0..2, a post-processor that prepends <|bos|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", tokenizer_config)
    write_json(directory / "config.json", config)
    write_json(directory / "generation_config.json", generation_config)
    return directory


def bpe_ranks(corpus: list[str], merges: int) -> dict[bytes, int]:
    """All 256 bytes, then `merges` byte-pair merges learnt from corpus's space-separated words (a leading space
    kept on each word but the first), in merge order: a valid tiktoken rank table."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter()
    for text in corpus:
        for i, word in enumerate(text.split(" ")):
            words[tuple(bytes([b]) for b in (word if i == 0 else " " + word).encode())] += 1
    for _ in range(merges):
        pairs = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_kimi_tokenizer(directory: Path, merges: int = 60, tokenizer_config: dict | None = None) -> Path:
    """Kimi-K2's tokenizer files: tiktoken.model (base64 token, space, rank per line), tokenizer_config.json with
    its added_tokens_decoder, special tokens, auto_map to tokenization_kimi and chat template; no tokenizer.json.
    The base vocabulary is 256 bytes + `merges`; the 256 specials follow."""
    ranks = bpe_ranks(KIMI_CORPUS, merges)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in ranks.items()]
    (directory / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    n = len(ranks)
    decoder = {
        str(n + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "special": True}
        for offset, name in KIMI_SPECIALS.items()
    }
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "chat_template": KIMI_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        **(tokenizer_config or {}),
    }
    write_json(directory / "tokenizer_config.json", config)
    return directory
