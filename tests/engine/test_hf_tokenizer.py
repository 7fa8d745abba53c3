"""HFTokenizer: tokenizer.json + tokenizer_config.json behind the engine's Tokenizer protocol.

Tiny vocabularies are built here with the `tokenizers` library itself, which then serves as the
oracle for decoding; the real SmolLM2 vocabulary is tested in test_demo_model.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from engine.tokenizers.hf import HFTokenizer, gpt2_byte_decoder, load_hf_tokenizer
from engine.tokenizers.tokenizer import Tokenizer, load_tokenizer
from engine.types import CheckpointError

tokenizers = pytest.importorskip("tokenizers")

BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r")]


def byte_level_tokenizer_json() -> str:
    """Specials 0..2, the 256 byte tokens (id 3 + byte), then one token per merge; GPT-2 split."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    by_byte = {b: c for c, b in gpt2_byte_decoder().items()}
    tokens = BYTE_SPECIALS + [by_byte[b] for b in range(256)] + [a + b for a, b in BYTE_MERGES]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=BYTE_MERGES))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    return tk.to_str()


def byte_id(char: str) -> int:
    return len(BYTE_SPECIALS) + ord(char)


def write_checkpoint_tokenizer(directory: Path, tokenizer_json: str, config: dict | None, generation: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


CHATML_CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> HFTokenizer:
    directory = write_checkpoint_tokenizer(tmp_path_factory.mktemp("bytes"), byte_level_tokenizer_json(), CHATML_CONFIG)
    return load_hf_tokenizer(directory)


def sentencepiece_style_tokenizer_json() -> str:
    """Llama-2-style HF tokenizer: "▁" for spaces, <0xNN> byte fallback, BOS by post-processor."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "hell", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    merges = [("▁", "h"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("l", "d"), ("▁wor", "ld")]  # fmt: skip
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tk.to_str()


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> HFTokenizer:
    directory = write_checkpoint_tokenizer(
        tmp_path_factory.mktemp("sp"), sentencepiece_style_tokenizer_json(), {"bos_token": "<s>", "eos_token": "</s>"}
    )
    return load_hf_tokenizer(directory)


# --------------------------------------------------------------------------- byte-level BPE
def test_protocol_and_basics(byte_tokenizer):
    tk = byte_tokenizer
    assert isinstance(tk, Tokenizer)
    assert tk.vocab_size == 3 + 256 + len(BYTE_MERGES)
    assert (tk.bos_id, tk.eos_id) == (None, 2)  # add_bos_token false: no BOS on raw prompts
    assert tk.stop_token_ids == frozenset({0, 2})  # eos, and <|endoftext|> by its end-of-text spelling
    assert tk.bos_token == "<|im_start|>" and tk.eos_token == "<|im_end|>"
    assert tk.encode("hi", bos=True, eos=True) == [byte_id("h"), byte_id("i"), 2]


def test_encode_merges_and_special_spellings_stay_text(byte_tokenizer):
    hello, the = 3 + 256 + 5, 3 + 256 + 2
    assert byte_tokenizer.encode("hello the") == [hello, the]
    assert byte_tokenizer.encode("<|im_end|>") == [byte_id(c) for c in "<|im_end|>"]


@pytest.mark.parametrize("text", ["hello the world", "  two  spaces\n\nand\ttabs ", "héllo wörld 🙂 日本語", "", "a<|im_start|>b"])
def test_round_trip(byte_tokenizer, text):
    assert byte_tokenizer.decode(byte_tokenizer.encode(text)) == text


def test_decode_matches_tokenizers_library(byte_tokenizer):
    from tokenizers import Tokenizer as RustTokenizer

    oracle = RustTokenizer.from_str(byte_level_tokenizer_json())
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, byte_tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        assert byte_tokenizer.decode(ids) == oracle.decode(ids)


def test_special_tokens(byte_tokenizer):
    tk = byte_tokenizer
    assert tk.decode([1, byte_id("a"), 2]) == "<|im_start|>a<|im_end|>"
    assert tk.decode([1, byte_id("a"), 2], skip_special_tokens=True) == "a"
    assert tk.is_special(2) and not tk.is_special(byte_id("a"))
    assert tk.special_token_id("<|im_end|>") == 2
    assert tk.special_token_name(1) == "<|im_start|>"
    with pytest.raises(KeyError):
        tk.special_token_id("hello")
    assert tk.token_bytes(byte_id("\n")) == b"\n"
    assert tk.token_bytes(tk.vocab_size) == b"" and tk.token_bytes(-1) == b""


def test_incremental_detokenizer_agrees_with_decode(byte_tokenizer):
    text = "héllo 🙂 the world, 日本語!"
    ids = byte_tokenizer.encode(text) + [2]
    detok = IncrementalDetokenizer(byte_tokenizer, skip_special_tokens=True)
    streamed = "".join(detok.push([i]) for i in ids) + detok.finish()
    assert streamed == byte_tokenizer.decode(ids, skip_special_tokens=True) == text


# --------------------------------------------------------------------------- sentencepiece-style BPE
def test_sentencepiece_style(sp_tokenizer):
    from tokenizers import Tokenizer as RustTokenizer

    tk = sp_tokenizer
    assert tk.bos_id == 1  # the post-processor adds <s>, so raw prompts start with BOS
    assert tk.stop_token_ids == frozenset({2})
    ids = tk.encode("hello world é", bos=True)
    assert ids[0] == 1
    assert tk.decode(ids, skip_special_tokens=True) == "hello world é"
    oracle = RustTokenizer.from_str(sentencepiece_style_tokenizer_json())
    assert tk.decode(ids[1:]) == oracle.decode(ids[1:])
    first = tk.token_bytes(ids[1])
    assert first.startswith(b" ") and tk.first_token_bytes(ids[1]) == first[1:]  # the dummy prefix goes
    detok = IncrementalDetokenizer(tk, skip_special_tokens=True)
    assert "".join(detok.push([i]) for i in ids) + detok.finish() == "hello world é"


# --------------------------------------------------------------------------- stop tokens and configs
def test_explicit_stop_token_ids_win(tmp_path):
    config = {**CHATML_CONFIG, "stop_token_ids": [2, 1]}
    tk = load_hf_tokenizer(write_checkpoint_tokenizer(tmp_path, byte_level_tokenizer_json(), config))
    assert tk.stop_token_ids == frozenset({1, 2})


def test_generation_config_eos_list(tmp_path):
    tk = load_hf_tokenizer(write_checkpoint_tokenizer(tmp_path, byte_level_tokenizer_json(), None, {"eos_token_id": [2, 1]}))
    assert tk.eos_id == 2 and tk.stop_token_ids == frozenset({0, 1, 2})


def test_load_through_family_hf(tmp_path):
    write_checkpoint_tokenizer(tmp_path, byte_level_tokenizer_json(), CHATML_CONFIG)
    assert load_tokenizer("hf", tmp_path / "tokenizer.json").eos_id == 2
    assert load_tokenizer("hf", tmp_path).eos_id == 2


@pytest.mark.parametrize(
    "tokenizer_json,config,match",
    [
        (None, CHATML_CONFIG, "tokenizer file not found"),
        ("{not json", CHATML_CONFIG, "not a readable tokenizer.json"),
        ("byte", {"eos_token": "<|nope|>"}, "eos_token '<\\|nope\\|>' is not in the vocabulary"),
        ("byte", {}, "no eos_token"),
        ("byte", {**CHATML_CONFIG, "stop_token_ids": [99999]}, "outside the vocabulary"),
    ],
)
def test_bad_checkpoints_are_refused(tmp_path, tokenizer_json, config, match):
    if tokenizer_json is not None:
        text = byte_level_tokenizer_json() if tokenizer_json == "byte" else tokenizer_json
        write_checkpoint_tokenizer(tmp_path, text, config)
    with pytest.raises(CheckpointError, match=match):
        load_hf_tokenizer(tmp_path)
