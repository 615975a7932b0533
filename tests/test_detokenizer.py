"""Incremental detokenization: UTF-8 safe streaming and stop strings that span tokens."""

from __future__ import annotations

from llmaccel.engine.detokenizer import IncrementalDetokenizer

CHINESE = "你好，世界！今天天气很好。我们一起去公园散步吧。"


def _stream(tokenizer, text, stop=(), prompt="Q:"):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), tuple(stop))
    deltas, stopped = [], False
    for token in tokenizer.encode(text):
        stopped = detok.add_token(token)
        deltas.append(detok.delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.delta(finished=True))
    return detok, deltas, stopped


def test_chinese_streams_whole_characters_only(tiny_tokenizer):
    ids = tiny_tokenizer.encode(CHINESE)
    assert len(ids) > len(CHINESE) / 2  # byte-level BPE splits characters across tokens
    detok, deltas, _ = _stream(tiny_tokenizer, CHINESE)
    assert "".join(deltas) == CHINESE == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_english_round_trips_with_spaces(tiny_tokenizer):
    text = " The quick brown fox jumps over the lazy dog."
    detok, deltas, _ = _stream(tiny_tokenizer, text)
    assert "".join(deltas) == text


def test_a_stop_string_spanning_tokens_ends_the_text_before_it(tiny_tokenizer):
    text = " The quick brown fox jumps over the lazy dog."
    stop = "fox jum"
    assert not any(stop in tiny_tokenizer.decode([t]) for t in tiny_tokenizer.encode(text))  # spans tokens
    detok, deltas, stopped = _stream(tiny_tokenizer, text, stop=[stop])
    assert stopped and detok.stop_string == stop
    assert detok.output_text == " The quick brown "
    assert "".join(deltas) == " The quick brown "  # nothing of the stop string was ever streamed


def test_the_earliest_of_several_stop_strings_wins(tiny_tokenizer):
    detok, _, stopped = _stream(tiny_tokenizer, " one two three four", stop=["four", "two"])
    assert stopped and detok.output_text == " one " and detok.stop_string == "two"


def test_a_chinese_stop_string(tiny_tokenizer):
    detok, deltas, stopped = _stream(tiny_tokenizer, CHINESE, stop=["天气"])
    assert stopped and detok.output_text == "你好，世界！今天"
    assert "".join(deltas) == "你好，世界！今天"
