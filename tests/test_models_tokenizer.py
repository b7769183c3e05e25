"""Tokenizers: byte-level for tiny, HF tokenizer.json (built here with the `tokenizers` library), streaming."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanocp.models import (
    ByteTokenizer,
    HFTokenizer,
    ModelConfig,
    StreamDecoder,
    TokenizerError,
    load_tokenizer,
)

BYTES = ByteTokenizer(ModelConfig.tiny())
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "naïve café 東京 🚀", "def f(x): return x"] * 20


def _render(tokenizer, messages) -> str:
    template = ImmutableSandboxedEnvironment().from_string(tokenizer.chat_template)
    return template.render(
        messages=messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_generation_prompt=True
    )


def _write_hf_tokenizer(directory, *, tokenizer_config=None, config=None, generation_config=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    for name, content in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _write_hf_tokenizer(
        tmp_path_factory.mktemp("hf_tok"),
        tokenizer_config={"chat_template": TEMPLATE, "eos_token": {"content": "<|eos|>"}, "bos_token": "<|bos|>"},
        config={"eos_token_id": 1},
        generation_config={"eos_token_id": [1, 2]},
    )


# ---- byte tokenizer ----------------------------------------------------------------------------------------


@settings(max_examples=200)
@given(st.text())
def test_byte_round_trip(text):
    ids = BYTES.encode(text)
    assert all(0 <= i < BYTES.vocab_size for i in ids)
    assert BYTES.decode(ids, skip_special_tokens=False) == text
    assert BYTES.decode(ids) == text.replace("<|bos|>", "").replace("<|eos|>", "").replace("<|pad|>", "").replace(
        "<|unk|>", ""
    )


def test_byte_specials_and_invalid_utf8():
    assert BYTES.encode("hi", add_special_tokens=True) == [256, ord("h"), ord("i")]
    assert BYTES.encode("a<|eos|>b") == [ord("a"), 257, ord("b")]
    assert BYTES.decode([256, 104, 105, 257, 258]) == "hi"
    assert BYTES.decode([0xE2, 0x82]) == "\ufffd"  # a cut-off 3-byte sequence
    assert BYTES.decode([0xFF, 65]) == "\ufffdA"
    with pytest.raises(TokenizerError, match="260"):
        BYTES.decode([260])


def test_byte_tokenizer_matches_tiny_model_and_rejects_other_vocabularies():
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    with pytest.raises(TokenizerError, match="does not match"):
        ByteTokenizer(ModelConfig.from_hf_dict({"model_type": "deepseek_v3", "num_hidden_layers": 1}))


def test_tiny_chat_template_renders_and_encodes_specials():
    text = _render(BYTES, [{"role": "user", "content": "hi"}])
    ids = BYTES.encode(text)
    assert ids[0] == BYTES.bos_token_id and BYTES.eos_token_ids[0] in ids
    assert BYTES.decode(ids) == "<|user|>hi<|assistant|>"


# ---- HF tokenizer.json -------------------------------------------------------------------------------------


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"])))
def test_hf_round_trip(hf_dir, text):
    tok = HFTokenizer.from_dir(hf_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text.replace("<|bos|>", "").replace("<|eos|>", "").replace("<|pad|>", "")
    assert tok.encode(text, add_special_tokens=True) == [tok.bos_token_id, *ids]


def test_hf_special_tokens_and_template(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == (1, 2) and tok.eos_token == "<|eos|>"
    assert tok.bos_token_id == 0 and tok.pad_token_id is None
    assert tok.chat_template == TEMPLATE
    text = _render(tok, [{"role": "user", "content": "hello world"}])
    ids = tok.encode(text)
    assert ids[-1] == 1 and tok.decode(ids) == "<|user|>hello world"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_hf_template_from_jinja_file_or_named_list(tmp_path):
    a = _write_hf_tokenizer(tmp_path / "a", tokenizer_config={"eos_token": "<|eos|>"})
    (a / "chat_template.jinja").write_text(TEMPLATE)
    assert HFTokenizer.from_dir(a).chat_template == TEMPLATE
    assert HFTokenizer.from_dir(a).eos_token_ids == (1,)
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    b = _write_hf_tokenizer(tmp_path / "b", tokenizer_config={"chat_template": named}, config={"eos_token_id": 2})
    tok = HFTokenizer.from_dir(b)
    assert tok.chat_template == TEMPLATE and tok.eos_token_ids == (2,)


def test_hf_tokenizer_file_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot load"):
        HFTokenizer.from_dir(tmp_path)
    _write_hf_tokenizer(tmp_path / "no_eos")
    with pytest.raises(TokenizerError, match="no eos token"):
        HFTokenizer.from_dir(tmp_path / "no_eos")
    _write_hf_tokenizer(tmp_path / "bad_cfg", tokenizer_config={"eos_token": "<|eos|>"})
    (tmp_path / "bad_cfg" / "config.json").write_text("{")
    with pytest.raises(TokenizerError, match=r"config\.json: not valid JSON"):
        HFTokenizer.from_dir(tmp_path / "bad_cfg")


# ---- streaming ---------------------------------------------------------------------------------------------


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(blacklist_categories=["Cs"])), use_hf=st.booleans())
def test_stream_decoder_emits_whole_characters_summing_to_the_text(hf_dir, text, use_hf):
    tok = HFTokenizer.from_dir(hf_dir) if use_hf else BYTES
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(text)]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(tok.encode(text))
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text
