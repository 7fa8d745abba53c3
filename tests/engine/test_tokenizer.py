"""Tokenizers: exact special-token ids, text that spells a special token, long inputs, round trips."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokenizers.tokenizer import Tokenizer, load_tokenizer, split_for_tiktoken
from engine.types import CheckpointError
from tests.engine.tokenizer_fixtures import (
    llama_models_file,
    real_llama3,
    real_llama4,
    tiny_llama2,
    tiny_llama2_path,
)

FAST = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def llama3():
    return real_llama3()


@pytest.fixture(scope="module")
def llama4():
    return real_llama4()


@pytest.fixture(scope="module")
def llama2():
    return tiny_llama2()


# --------------------------------------------------------------------------- Llama 3.x
def test_llama3_special_tokens_have_their_exact_ids(llama3):
    expected = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|reserved_special_token_0|>": 128002,
        "<|reserved_special_token_1|>": 128003,
        "<|finetune_right_pad_id|>": 128004,
        "<|step_id|>": 128005,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
        "<|image|>": 128011,
        "<|reserved_special_token_2|>": 128012,
        "<|reserved_special_token_245|>": 128255,
    }
    assert {name: llama3.special_token_id(name) for name in expected} == expected
    assert llama3.vocab_size == 128256
    assert (llama3.bos_id, llama3.eos_id) == (128000, 128001)
    assert llama3.stop_token_ids == frozenset({128001, 128008, 128009})  # end_of_text, eom_id, eot_id
    assert llama3.is_special(128000) and llama3.is_special(128255)
    assert not llama3.is_special(127999) and not llama3.is_special(128256)
    with pytest.raises(KeyError):
        llama3.special_token_id("<|eot|>")


def test_llama3_matches_the_reference_tokenizer(llama3):
    from llama_models.llama3.tokenizer import Tokenizer as Reference

    reference = Reference(llama_models_file("llama3/tokenizer.model"))
    assert llama3.special_tokens == reference.special_tokens
    text = "Hello world! Ça va? 東京 🦙\n\n  def f(x):\n\treturn x**2  # 12345"
    assert llama3.encode(text, bos=True) == reference.encode(text, bos=True, eos=False)


def test_llama3_encodes_known_ids(llama3):
    assert llama3.encode("Hello world") == [9906, 1917]
    assert llama3.encode("Hello world", bos=True, eos=True) == [128000, 9906, 1917, 128001]
    assert llama3.encode("") == []
    assert llama3.encode("\n\n") == [271]


# --------------------------------------------------------------------------- Llama 4
def test_llama4_special_tokens_have_their_exact_ids(llama4):
    expected = {
        "<|begin_of_text|>": 200000,
        "<|end_of_text|>": 200001,
        "<|fim_prefix|>": 200002,
        "<|fim_middle|>": 200003,
        "<|fim_suffix|>": 200004,
        "<|header_start|>": 200005,
        "<|header_end|>": 200006,
        "<|eom|>": 200007,
        "<|eot|>": 200008,
        "<|step|>": 200009,
        "<|text_post_train_reserved_special_token_0|>": 200010,
        "<|python_start|>": 200016,
        "<|python_end|>": 200017,
        "<|finetune_right_pad|>": 200018,
        "<|text_post_train_reserved_special_token_8|>": 200019,
        "<|text_post_train_reserved_special_token_68|>": 200079,
        "<|image_start|>": 200080,
        "<|image_end|>": 200081,
        "<|tile_x_separator|>": 200084,
        "<|tile_y_separator|>": 200085,
        "<|image|>": 200090,
        "<|patch|>": 200092,
        "<|vision_reserved_special_token_1047|>": 201133,
        "<|reasoning_reserved_special_token_0|>": 201134,
        "<|reasoning_thinking_start|>": 201142,
        "<|reasoning_thinking_end|>": 201143,
        "<|reserved_special_token_0|>": 201144,
        "<|reserved_special_token_903|>": 202047,
    }
    assert {name: llama4.special_token_id(name) for name in expected} == expected
    assert llama4.vocab_size == 202048
    assert (llama4.bos_id, llama4.eos_id) == (200000, 200001)
    assert llama4.stop_token_ids == frozenset({200001, 200007, 200008})  # end_of_text, eom, eot


def test_llama4_matches_the_reference_tokenizer(llama4):
    from llama_models.llama4.tokenizer import Tokenizer as Reference

    reference = Reference(llama_models_file("llama4/tokenizer.model"))
    assert llama4.special_tokens == reference.special_tokens
    text = "Hello World's CAMELCase don't/path\n\n東京 🦙 3.14159"
    assert llama4.encode(text, bos=True) == reference.encode(text, bos=True, eos=False)
    assert llama4.encode("Hello world") == [19873, 3817]


# --------------------------------------------------------------------------- user text is text
@pytest.mark.parametrize("which", ["llama3", "llama4"])
def test_special_spellings_in_user_text_stay_text(which, llama3, llama4):
    tok = {"llama3": llama3, "llama4": llama4}[which]
    text = "<|begin_of_text|><|eot_id|><|eot|><|header_start|><|python_tag|> hi"
    ids = tok.encode(text)
    assert not any(tok.is_special(t) for t in ids)
    assert tok.decode(ids) == text


def test_sentencepiece_control_spellings_stay_text(llama2):
    ids = llama2.encode("<s>hi</s>")
    assert llama2.bos_id not in ids and llama2.eos_id not in ids
    assert llama2.decode(ids) == "<s>hi</s>"


# --------------------------------------------------------------------------- long inputs
def test_long_runs_of_one_character_are_encoded_safely(llama3):
    text = "a" * 1_000_000
    ids = llama3.encode(text)
    assert llama3.decode(ids) == text


def test_long_ordinary_text_tokenizes_as_one_call_would(llama3, llama4):
    text = "Hello there, how are you today?\n  Fine.\n" * 15_000  # 600k characters, several chunks
    for tok in (llama3, llama4):
        assert tok.encode(text) == tok._encoding.encode_ordinary(text)


@given(st.text(alphabet=st.sampled_from("ab \n\t.é"), max_size=300), st.integers(1, 40), st.integers(40, 120))
@FAST
def test_split_for_tiktoken_respects_both_limits(text, max_run, max_chunk):
    chunks = list(split_for_tiktoken(text, max_chunk_chars=max_chunk, max_run_chars=max_run))
    assert "".join(chunks) == text
    import re

    for chunk in chunks:
        assert len(chunk) <= max(max_chunk, max_run)
        assert all(len(run) <= max_run for run in re.findall(r"\s+|\S+", chunk))


# --------------------------------------------------------------------------- round trips
@given(st.text(max_size=200))
@FAST
def test_tiktoken_round_trip(text):
    for tok in (real_llama3(), real_llama4()):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids)) == ids


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=100))
@FAST
def test_sentencepiece_round_trip(text):
    tok = tiny_llama2()
    ids = tok.encode(text)
    # sentencepiece adds a dummy-prefix space that decoding removes again
    assert tok.decode(ids) == text
    assert tok.encode(tok.decode(ids)) == ids


@given(st.lists(st.integers(0, 399), max_size=30))
@FAST
def test_sentencepiece_decode_matches_the_library_on_valid_utf8(ids):
    tok = tiny_llama2()
    ours = tok.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in ours:  # invalid UTF-8: one U+FFFD per bad sequence here, per byte there
        assert ours == tok._sp.decode(ids)


def test_sentencepiece_leading_space_rules(llama2):
    piece = llama2._sp.piece_to_id
    hello, space, byte_space = piece("\u2581hello"), piece("\u2581"), piece("<0x20>")
    assert llama2.decode([hello, hello]) == "hello hello"  # dummy prefix dropped once
    assert llama2.decode([llama2.bos_id, hello], skip_special_tokens=True) == "hello"
    assert llama2.decode([space, hello]) == " hello"
    assert llama2.decode([byte_space, hello]) == "  hello"  # a byte piece is real text
    assert llama2.decode([llama2.bos_id, hello]) == "<s>hello"
    assert (llama2.vocab_size, llama2.bos_id, llama2.eos_id) == (400, 1, 2)
    assert llama2.stop_token_ids == frozenset({2})
    assert llama2.special_token_id("</s>") == 2 and llama2.is_special(1) and not llama2.is_special(0)


def test_token_bytes_of_every_kind_of_token(llama3, llama2):
    assert llama3.token_bytes(9906) == b"Hello"
    assert llama3.token_bytes(128009) == b"<|eot_id|>"
    assert llama3.token_bytes(10**9) == b"" and llama3.token_bytes(-1) == b""
    assert llama3.decode([9906, 10**9, 128009], skip_special_tokens=True) == "Hello"
    assert b"".join(llama3.token_bytes(t) for t in llama3.encode("🦙")) == "🦙".encode()
    assert llama2.token_bytes(llama2._sp.piece_to_id("<0xE2>")) == b"\xe2"
    assert llama2.token_bytes(0) == " \u2047 ".encode()  # <unk>, as sentencepiece prints it


def test_every_tokenizer_satisfies_the_protocol(llama3, llama4, llama2):
    for tok in (llama3, llama4, llama2):
        assert isinstance(tok, Tokenizer)


# --------------------------------------------------------------------------- loading
def test_load_tokenizer_by_family(monkeypatch):
    path3 = llama_models_file("llama3/tokenizer.model")
    assert load_tokenizer("llama3_1", path3).vocab_size == 128256
    assert load_tokenizer("llama2", tiny_llama2_path()).vocab_size == 400
    import engine.tokenizers.tokenizer as module

    monkeypatch.setattr(module, "llama3_tokenizer", lambda path: ("llama3", path))
    monkeypatch.setattr(module, "llama4_tokenizer", lambda path: ("llama4", path))
    for family in ("llama3", "llama3_1", "llama3_2", "llama3_3", "llama4"):
        assert load_tokenizer(family, path3) == (family[:6], path3)


def test_a_tokenizer_of_another_family_is_refused():
    with pytest.raises(CheckpointError, match="128000 BPE tokens"):
        load_tokenizer("llama3", llama_models_file("llama4/tokenizer.model"))
    with pytest.raises(CheckpointError, match="not a sentencepiece model"):
        load_tokenizer("llama2", llama_models_file("llama3/tokenizer.model"))


def test_missing_or_broken_files_raise_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_tokenizer("llama3", tmp_path / "nope.model")
    bad = tmp_path / "tokenizer.model"
    bad.write_text("!!! not base64\n")
    with pytest.raises(CheckpointError, match="not a tiktoken BPE line"):
        load_tokenizer("llama4", bad)
    with pytest.raises(CheckpointError, match="no tokenizer for model family"):
        load_tokenizer("gpt2", bad)  # type: ignore[arg-type]


def test_hf_family_dispatches_to_the_hf_module(monkeypatch, tmp_path):
    import types

    fake = types.ModuleType("engine.tokenizers.hf")
    fake.load_hf_tokenizer = lambda path: ("hf", path)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engine.tokenizers.hf", fake)
    assert load_tokenizer("hf", tmp_path) == ("hf", tmp_path)


def test_hf_family_without_the_hf_module_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "engine.tokenizers.hf", None)  # import raises ImportError
    with pytest.raises(CheckpointError, match="HF tokenizers are not available"):
        load_tokenizer("hf", tmp_path)
