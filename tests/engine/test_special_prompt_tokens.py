"""encode(parse_special=True): a completions text prompt's special-token spellings become the
model's special tokens, for every tokenizer kind; without it they stay text (chat content)."""

from __future__ import annotations

import pytest

from tests.engine.tokenizer_fixtures import real_llama3, real_llama4, tiny_llama2


def test_llama3_parses_every_special_spelling():
    tok = real_llama3()
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = tok.encode(text, parse_special=True)
    assert ids == [128000, 128006, *tok.encode("user"), 128007, *tok.encode("\n\nhi"), 128009]
    assert tok.decode(ids) == text
    assert not any(tok.is_special(t) for t in tok.encode(text))  # the default: text stays text


def test_llama4_parses_its_header_tokens():
    tok = real_llama4()
    ids = tok.encode("<|header_start|>user<|header_end|>", parse_special=True)
    assert ids == [tok.special_token_id("<|header_start|>"), *tok.encode("user"), tok.special_token_id("<|header_end|>")]


def test_sentencepiece_parses_control_spellings():
    tok = tiny_llama2()
    ids = tok.encode("hi</s>", bos=True, parse_special=True)
    assert ids == [tok.bos_id, *tok.encode("hi"), tok.eos_id]


def test_hf_tokenizer_parses_special_added_tokens(tmp_path):
    pytest.importorskip("tokenizers")
    from engine.tokenizers.hf import load_hf_tokenizer
    from tests.engine.test_hf_tokenizer import CHATML_CONFIG, byte_id, byte_level_tokenizer_json, write_checkpoint_tokenizer

    tok = load_hf_tokenizer(write_checkpoint_tokenizer(tmp_path, byte_level_tokenizer_json(), CHATML_CONFIG))
    assert tok.encode("<|im_start|>a<|im_end|>", parse_special=True) == [1, byte_id("a"), 2]
    assert tok.encode("<|im_end|>") == [byte_id(c) for c in "<|im_end|>"]
    assert tok.encode("x<|endoftext|>", parse_special=True) == [byte_id("x"), 0]
