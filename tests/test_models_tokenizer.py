"""Tokenizers: byte-level for tiny, HF tokenizer.json (built with the `tokenizers` library), Kimi-K2's tiktoken
(tiktoken.model + tokenizer_config.json), the one prompt rule (BOS as tokenizer_config.json says), padded
vocabularies, streaming."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizer_dirs import write_hf_tokenizer, write_kimi_tokenizer

from nanocp.models import (
    ByteTokenizer,
    HFTokenizer,
    ModelConfig,
    StreamDecoder,
    TiktokenTokenizer,
    TokenizerError,
    encode_chat,
    encode_prompt,
    load_tokenizer,
)
from nanocp.models.tiktoken_tokenizer import KIMI_PATTERN, split_long_runs

BYTES = ByteTokenizer(ModelConfig.tiny())
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"


def _render(tokenizer, messages) -> str:
    template = ImmutableSandboxedEnvironment().from_string(tokenizer.chat_template)
    return template.render(
        messages=messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_generation_prompt=True
    )


_write_hf_tokenizer = write_hf_tokenizer


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
    assert BYTES.decode([104, 260, 105, 10**6]) == "hi"  # ids past the vocabulary have no token
    with pytest.raises(TokenizerError, match="negative"):
        BYTES.decode([-1])


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
    hello = tok.encode("hello")
    assert tok.decode([*hello, tok.vocab_size, tok.vocab_size + 7, *hello]) == "hellohello"  # padded ids: no text
    with pytest.raises(TokenizerError, match="negative"):
        tok.decode([-3])


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


# ---- the prompt rule: BOS as tokenizer_config.json says -----------------------------------------------------


@pytest.mark.parametrize(
    ("tokenizer_config", "bos", "eos"),
    [
        ({}, True, False),  # no add_bos_token / add_eos_token: tokenizer.json's post-processor (prepends <|bos|>)
        ({"add_bos_token": True, "add_eos_token": False}, True, False),  # DeepSeek-V3 / R1
        ({"add_bos_token": False}, False, False),
        ({"add_eos_token": True}, False, True),  # one given: the other is off, as transformers rebuilds it
    ],
)
def test_prompt_special_tokens_follow_tokenizer_config(tmp_path, tokenizer_config, bos, eos):
    config = {"eos_token": "<|eos|>", "bos_token": "<|bos|>", **tokenizer_config}
    tok = load_tokenizer(str(write_hf_tokenizer(tmp_path, tokenizer_config=config)))
    plain = tok.encode("hello world")
    assert encode_prompt(tok, "hello world") == [0] * bos + plain + [1] * eos
    assert encode_prompt(tok, [5, 6]) == [5, 6]  # ids are taken as they are
    assert encode_chat(tok, "<|bos|>hello") == [0, *tok.encode("hello")]  # a template writes its own BOS
    assert encode_prompt(BYTES, "hi") == [BYTES.bos_token_id, 104, 105]


def test_add_bos_token_without_a_bos_token_is_an_error(tmp_path):
    write_hf_tokenizer(tmp_path, tokenizer_config={"eos_token": "<|eos|>", "add_bos_token": True})
    with pytest.raises(TokenizerError, match="add_bos_token is true but there is no bos token"):
        load_tokenizer(str(tmp_path))


# ---- Kimi-K2's tiktoken -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    directory = write_kimi_tokenizer(tmp_path_factory.mktemp("kimi"))
    base = _base_vocab(directory)
    (directory / "config.json").write_text(f'{{"eos_token_id": {base + 1}}}')  # [EOS]
    (directory / "generation_config.json").write_text(f'{{"eos_token_id": {base + 2}}}')  # <|im_end|>
    return directory


def _base_vocab(directory) -> int:
    return len((directory / "tiktoken.model").read_bytes().splitlines())


KIMI_TEXTS = [
    "hello world, hello Kimi",
    "你好世界 hello你好",
    "The MODEL's answer isn't 1234567!",
    "def f(x):\n    return x\n\n\n  tail  ",
    "naïve café 東京 🚀 ÉCOLE l'été",
    "[BOS]x<|im_end|>",
]


def test_kimi_tiktoken_reads_the_checkpoint_files(kimi_dir):
    tok = load_tokenizer(str(kimi_dir))
    assert isinstance(tok, TiktokenTokenizer)
    base = _base_vocab(kimi_dir)
    assert base > 256 + 30 and tok.vocab_size == base + 256
    assert tok.special_tokens["[BOS]"] == base and tok.special_tokens["<|im_middle|>"] == base + 17
    assert tok.special_tokens[f"<|reserved_token_{base + 5}|>"] == base + 5  # unnamed specials are reserved
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token, tok.pad_token_id) == (base, "[BOS]", "[EOS]", base + 255)
    assert tok.eos_token_ids == (base + 1, base + 2)
    assert tok.chat_template.startswith("{%- for message in messages")
    assert tok.encode("[BOS]x<|im_end|>") == [base, ord("x"), base + 2]  # special strings become their ids
    assert encode_prompt(tok, "x") == [ord("x")]  # Kimi's code adds no BOS and its tokenizer_config says nothing


def test_kimi_tiktoken_pre_tokenizes_han_numbers_and_contractions_apart(kimi_dir):
    tok = TiktokenTokenizer.from_dir(kimi_dir)
    for whole, parts in [
        ("你好abc", ["你好", "abc"]),
        ("12345", ["123", "45"]),
        ("It's", ["It's"]),
        ("abc你好def", ["abc", "你好", "def"]),
    ]:
        assert tok.encode(whole) == [i for p in parts for i in tok.encode(p)], whole
    assert tok.encode("hello") == [tok.encoding.encode_single_token(b"hello")]  # a learnt merge


@pytest.fixture(scope="module")
def kimi_converted(kimi_dir):
    """transformers' TikTokenConverter: a `tokenizers` BPE built from the same file and pattern (its own merge
    algorithm, the regex through Oniguruma), an independent reading to agree with."""
    conversion = pytest.importorskip("transformers.convert_slow_tokenizer")
    return conversion.TikTokenConverter(str(kimi_dir / "tiktoken.model"), pattern=KIMI_PATTERN).converted()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(blacklist_categories=["Cs"])) | st.sampled_from(KIMI_TEXTS))
def test_kimi_tiktoken_round_trips_and_equals_the_transformers_conversion(kimi_dir, kimi_converted, text):
    tok = _kimi(kimi_dir)
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if not any(name in text for name in tok.special_tokens):
        assert kimi_converted.encode(text, add_special_tokens=False).ids == ids


_KIMI = {}


def _kimi(directory) -> TiktokenTokenizer:
    if directory not in _KIMI:
        _KIMI[directory] = TiktokenTokenizer.from_dir(directory)
    return _KIMI[directory]


def test_kimi_tiktoken_padded_ids_and_long_runs(kimi_dir):
    tok = TiktokenTokenizer.from_dir(kimi_dir)
    hello = tok.encode("hello")
    assert tok.decode([*hello, tok.vocab_size, tok.vocab_size + 100, *hello]) == "hellohello"
    assert tok.decode([tok.bos_token_id, *hello]) == "hello"
    assert tok.decode([tok.bos_token_id, *hello], skip_special_tokens=False) == "[BOS]hello"
    long = "a" * 60_000 + " " * 30_000 + "b"
    pieces = ["a" * 25_000, "a" * 25_000, "a" * 10_000 + " " * 25_000, " " * 5_000 + "b"]  # runs cut at 25,000
    assert list(split_long_runs(long, 25_000)) == pieces
    assert tok.decode(tok.encode(long)) == long


def test_kimi_tokenizer_config_add_bos_token_is_honoured(tmp_path):
    tok = load_tokenizer(str(write_kimi_tokenizer(tmp_path, tokenizer_config={"add_bos_token": True})))
    assert encode_prompt(tok, "x") == [tok.bos_token_id, ord("x")]


def test_tiktoken_file_errors_name_the_problem(tmp_path):
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json and no tiktoken\.model"):
        load_tokenizer(str(tmp_path))
    bad_line = write_kimi_tokenizer(tmp_path / "bad_line")
    with (bad_line / "tiktoken.model").open("ab") as f:
        f.write(b"not-base64!! 9999\n")
    with pytest.raises(TokenizerError, match=rf"tiktoken\.model:{_base_vocab(bad_line)}: expected '<base64 token>"):
        load_tokenizer(str(bad_line))
    other = write_kimi_tokenizer(
        tmp_path / "other", tokenizer_config={"auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}
    )
    with pytest.raises(TokenizerError, match=r"'tokenization_qwen\.QWenTokenizer' is not one nanocp reads"):
        load_tokenizer(str(other))
    few = write_kimi_tokenizer(tmp_path / "few")
    lines = (few / "tiktoken.model").read_bytes().splitlines()
    (few / "tiktoken.model").write_bytes(b"\n".join(lines[1:]))
    with pytest.raises(TokenizerError, match=f"not 0..{len(lines) - 2}"):
        load_tokenizer(str(few))


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
