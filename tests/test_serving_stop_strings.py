"""Stop strings checked on a window of the latest tokens (nanocp/stop_strings.py) stop exactly where searching the
whole decoded text after every token stops, and cut the text at the same place."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_models_tokenizer import BYTES, _write_hf_tokenizer

from nanocp.models import HFTokenizer
from nanocp.stop_strings import stop_string_end

PIECES = ["a", "b", "ab", " ", "\n", "é", "東", "🚀", "ba", "\n\n"]  # few letters: stop strings do turn up


def whole_text_end(tokenizer, output, stops) -> int | None:
    """The plain reference: decode everything, take the earliest match."""
    text = tokenizer.decode(output)
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def first_stop(tokenizer, output, stops, check) -> tuple[int, int] | None:
    """Append the output token by token, checking after each: (tokens so far, cut) at the first match."""
    for n in range(1, len(output) + 1):
        end = check(tokenizer, output[:n], stops)
        if end is not None:
            return n, end
    return None


stops_strategy = st.lists(st.text(alphabet="ab \né東", min_size=1, max_size=5), min_size=1, max_size=3)


@st.composite
def byte_outputs(draw) -> list[int]:
    """Byte-tokenizer outputs: UTF-8 of random pieces, with stray continuation bytes and special tokens mixed in."""
    out: list[int] = []
    for _ in range(draw(st.integers(20, 160))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            out.append(draw(st.integers(0x80, 0xBF)))  # a byte that cannot start a character
        elif kind == 1:
            out.append(draw(st.integers(256, 259)))  # specials decode to nothing
        else:
            out.extend(draw(st.sampled_from(PIECES)).encode())
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(byte_outputs(), stops_strategy)
def test_byte_tokenizer_stops_where_the_whole_text_search_stops(output, stops):
    assert first_stop(BYTES, output, stops, stop_string_end) == first_stop(BYTES, output, stops, whole_text_end)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer.from_dir(_write_hf_tokenizer(tmp_path_factory.mktemp("stop_bpe"), config={"eos_token_id": 1}))


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> HFTokenizer:
    """A sentencepiece-style tokenizer: its decoder strips the leading space of the first token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["a b ab ba", "ab ba b a", "é 東 ab", "b a\nab"] * 30
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|eos|>"]))
    directory = tmp_path_factory.mktemp("stop_metaspace")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text('{"eos_token_id": 1}')
    return HFTokenizer.from_dir(directory)


@pytest.mark.parametrize("name", ["bpe", "metaspace"])
def test_hf_tokenizers_stop_where_the_whole_text_search_stops(name, request):
    tokenizer = request.getfixturevalue(name)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=20, max_size=160), stops_strategy)
    def check(output, stops):
        expected = first_stop(tokenizer, output, stops, whole_text_end)
        assert first_stop(tokenizer, output, stops, stop_string_end) == expected

    check()


def test_a_long_output_decodes_only_its_window(monkeypatch):
    calls = []
    decode = BYTES.decode
    monkeypatch.setattr(BYTES, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw))
    output = list(b"ab " * 400)
    assert stop_string_end(BYTES, output, ["\n\n"]) is None
    assert max(calls) < 100  # not the 1,200 tokens of the whole output
    assert stop_string_end(BYTES, output + list(b"\n\n"), ["\n\n"]) == 1200


def test_matches_found_late_in_long_outputs_agree():
    # long outputs, rarer stop strings: most matches come after the window covers only part of the output
    rnd = random.Random(5)
    late = 0
    for _ in range(120):
        output = [b for _ in range(rnd.randint(100, 250)) for b in rnd.choice(PIECES).encode()]
        stops = ["".join(rnd.choice("ab é東\n") for _ in range(rnd.randint(3, 5))) for _ in range(2)]
        found = first_stop(BYTES, output, stops, stop_string_end)
        assert found == first_stop(BYTES, output, stops, whole_text_end)
        late += found is not None and found[0] > 4 * (max(map(len, stops)) + 8) + 16
    assert late >= 20
