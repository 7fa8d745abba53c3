"""The incremental detokenizer equals one-shot decoding, never splits a character, and cuts at
stop strings that span token boundaries while holding back no more than it must."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.detokenizer import IncrementalDetokenizer
from tests.engine.tokenizer_fixtures import real_llama3, real_llama4, tiny_llama2

FAST = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENIZERS = {"llama3": real_llama3, "llama4": real_llama4, "llama2": tiny_llama2}


def stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Push `ids` in pieces of the given sizes (cycled), then finish; returns every delta."""
    deltas, at, i = [], 0, 0
    while at < len(ids):
        size = max(1, sizes[i % len(sizes)]) if sizes else 1
        deltas.append(detok.push(ids[at : at + size]))
        at, i = at + size, i + 1
    deltas.append(detok.finish())
    return deltas


def token_ids(draw, tokenizer) -> list[int]:
    """Random ids: ordinary tokens, single-byte tokens (to split characters) and specials."""
    byte_tokens = [t for t in tokenizer.encode("é🦙東京\u2047") if len(tokenizer.token_bytes(t)) >= 1]
    specials = sorted(tokenizer.stop_token_ids | ({tokenizer.bos_id} if tokenizer.bos_id is not None else set()))
    pick = st.one_of(
        st.integers(0, min(tokenizer.vocab_size - 1, 150_000)),
        st.sampled_from(byte_tokens),
        st.sampled_from(specials),
    )
    return draw(st.lists(pick, max_size=40))


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@given(data=st.data(), sizes=st.lists(st.integers(1, 5), max_size=6))
@FAST
def test_streaming_equals_one_shot_decode(family, skip_special_tokens, data, sizes):
    tokenizer = TOKENIZERS[family]()
    ids = token_ids(data.draw, tokenizer)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.stop_matched is None


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_a_character_split_across_tokens_is_emitted_whole(family):
    tokenizer = TOKENIZERS[family]()
    text = "a🦙b東"
    byte_ids = [_byte_token(tokenizer, bytes([b])) for b in text.encode()]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in byte_ids]
    assert deltas == ["a", "", "", "", "🦙", "b", "", "", "東"]
    assert detok.finish() == ""


def test_a_truncated_character_at_the_end_becomes_a_replacement_character():
    tokenizer = real_llama3()
    detok = IncrementalDetokenizer(tokenizer)
    ids = [_byte_token(tokenizer, b"x"), _byte_token(tokenizer, b"\xf0"), _byte_token(tokenizer, b"\x9f")]
    assert [detok.push([t]) for t in ids] == ["x", "", ""]
    assert detok.finish() == "\ufffd" == tokenizer.decode(ids)[1:]


def test_sentencepiece_leading_space_is_dropped_once_even_after_specials():
    tokenizer = tiny_llama2()
    hello = tokenizer._sp.piece_to_id("\u2581hello")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push([tokenizer.bos_id]) == ""
    assert detok.push([hello]) == "hello"
    assert detok.push([hello]) == " hello"


def test_special_tokens_appear_only_when_asked():
    tokenizer = real_llama3()
    ids = tokenizer.encode("Hi") + [128009]  # <|eot_id|>
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids, [1])) == "Hi"
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(shown, ids, [1])) == "Hi<|eot_id|>"


# --------------------------------------------------------------------------- stop strings
def test_stop_string_split_across_tokens():
    tokenizer = real_llama3()
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer, stop=["END"])
    out = []
    for t in ids:
        out.append(detok.push([t]))
        if detok.stop_matched:
            break
    assert "".join(out) == "The answer is 42. "
    assert detok.stop_matched == "END"
    assert detok.push(tokenizer.encode(" more")) == "" and detok.finish() == ""


def test_text_is_held_back_only_while_it_could_start_a_stop_string():
    tokenizer = real_llama3()
    detok = IncrementalDetokenizer(tokenizer, stop=["</answer>"])
    assert detok.push(tokenizer.encode("x <")) == "x "  # "<" could start "</answer>"
    assert detok.push(tokenizer.encode("/ans")) == ""
    assert detok.push(tokenizer.encode("wers")) == "</answers"  # no longer a prefix: released
    assert detok.finish() == ""


def test_held_back_text_is_flushed_by_finish():
    tokenizer = real_llama3()
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    assert detok.push(tokenizer.encode("go ST")) == "go "
    assert detok.finish() == "ST"
    assert detok.stop_matched is None


def test_earliest_stop_string_wins():
    tokenizer = real_llama4()
    detok = IncrementalDetokenizer(tokenizer, stop=["world", "lo w"])
    assert "".join(stream(detok, tokenizer.encode("hello world"), [20])) == "hel"
    assert detok.stop_matched == "lo w"


def test_stop_string_inside_one_token_and_across_a_multibyte_character():
    tokenizer = real_llama3()
    ids = tokenizer.encode("naïve café🦙 done")
    detok = IncrementalDetokenizer(tokenizer, stop=["é🦙"])
    assert "".join(stream(detok, ids, [1])) == "naïve caf"
    assert detok.stop_matched == "é🦙"


@given(
    text=st.text(alphabet=st.sampled_from("ab c\né🦙"), max_size=60),
    stops=st.lists(st.text(alphabet=st.sampled_from("ab c\né🦙"), min_size=1, max_size=4), max_size=3),
    sizes=st.lists(st.integers(1, 4), max_size=5),
)
@FAST
def test_stop_strings_property(text, stops, sizes):
    tokenizer = real_llama3()
    detok = IncrementalDetokenizer(tokenizer, stop=stops)
    emitted = ""
    ids = tokenizer.encode(text)
    for delta in stream(detok, ids, sizes):
        emitted += delta
    hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    if hits:
        at, which = min(hits)
        assert emitted == text[:at]
        assert detok.stop_matched == stops[which]
    else:
        assert emitted == text and detok.stop_matched is None


def test_work_per_push_does_not_grow_with_the_text():
    tokenizer = real_llama3()
    detok = IncrementalDetokenizer(tokenizer, stop=["<never>"])
    token = tokenizer.encode(" word")
    for _ in range(5000):
        detok.push(token)
    assert len(detok._pending) < len("<never>")  # nothing accumulates beyond a possible stop prefix


def _byte_token(tokenizer, data: bytes) -> int:
    """The id of the token whose bytes are exactly `data` (every byte has one)."""
    sp = getattr(tokenizer, "_sp", None)
    if sp is not None:  # sentencepiece byte-fallback pieces
        return sp.piece_to_id(f"<0x{data[0]:02X}>")
    return tokenizer._encoding.encode_single_token(data)


# --------------------------------------------------------------------------- incremental stop matching (issue 16)
def test_kmp_prefix_matcher_agrees_with_brute_force():
    import random

    from engine.core.detokenizer import _PrefixMatcher

    def brute(text: str, pattern: str) -> int:
        return max((k for k in range(len(pattern) + 1) if text.endswith(pattern[:k])), default=0)

    rng = random.Random(16)
    for _ in range(300):
        pattern = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        matcher = _PrefixMatcher(pattern)
        text = ""
        for _ in range(rng.randint(1, 6)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
            text += piece
            matcher.feed(piece)
            if pattern not in text:  # the detokenizer stops at a full match; before it, states agree
                assert matcher.matched == brute(text, pattern), (pattern, text)
