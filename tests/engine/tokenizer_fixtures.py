"""Real and tiny tokenizers for the tokenizer, detokenizer, chat-format and tool-parser tests.

The real Llama 3 and Llama 4 `tokenizer.model` files ship in the llama-models package (tests may
read its files; the server never imports it). No Llama 2 tokenizer ships, so a tiny sentencepiece
model with Llama 2's settings (BPE, byte fallback, dummy prefix, no whitespace folding) is trained
once per process from a small fixed corpus.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import random
from pathlib import Path

import pytest

from engine.tokenizers.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, llama3_tokenizer, llama4_tokenizer


def llama_models_file(relative: str) -> Path:
    spec = importlib.util.find_spec("llama_models")
    if spec is None or spec.origin is None:
        pytest.skip("llama-models is not installed")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        pytest.skip(f"llama-models has no {relative}")
    return path


@functools.lru_cache(maxsize=None)
def real_llama3() -> TiktokenTokenizer:
    return llama3_tokenizer(llama_models_file("llama3/tokenizer.model"))


@functools.lru_cache(maxsize=None)
def real_llama4() -> TiktokenTokenizer:
    return llama4_tokenizer(llama_models_file("llama4/tokenizer.model"))


_WORDS = (
    "the quick brown fox jumps over lazy dog hello world llama tokenizer café naïve 東京 日本語 "
    "emoji 🦙 test [INST] [/INST] <<SYS>> <</SYS>> system user assistant 42 3.14 { } ( ) , . ! ?"
).split()


@functools.lru_cache(maxsize=None)
def tiny_sentencepiece_model() -> bytes:
    import sentencepiece

    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


@functools.lru_cache(maxsize=None)
def tiny_llama2_path() -> Path:
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="llamaserve-sp-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = Path(directory) / "tokenizer.model"
    path.write_bytes(tiny_sentencepiece_model())
    return path


@functools.lru_cache(maxsize=None)
def tiny_llama2() -> SentencePieceTokenizer:
    return SentencePieceTokenizer(tiny_llama2_path())
