"""Constrained decoding in the engine: masks for every tokenizer kind, matchers that survive
preemption and prefix-cache hits, one matcher per choice, the compile cache and its limits."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import zlib

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampler import Sampler
from engine.core.sequence import ScheduledBatch, Sequence, StepOutput
from engine.core import structured
from engine.core.structured import GrammarCompiler
from engine.types import EngineRequest, GrammarSpec, InvalidRequest, SamplingParams
from tests.engine.fakes import FakeRunner, FakeTokenizer
from tests.engine.test_core import run
from tests.engine.tokenizer_fixtures import real_llama3, tiny_llama2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "n", "kind", "tags"],
    "additionalProperties": False,
}
JSON_SPEC = GrammarSpec("json", json.dumps(SCHEMA), "response_format")
REGEX = r"[a-c]{2,5}-[0-9]{2}"


def hf_byte_level():
    from engine.tokenizers.hf import HFTokenizer
    from tests.engine.test_hf_tokenizer import CHATML_CONFIG, byte_level_tokenizer_json

    return HFTokenizer(byte_level_tokenizer_json(), CHATML_CONFIG, source="test")


TOKENIZERS = {"tiktoken": real_llama3, "sentencepiece": tiny_llama2, "tokenizer.json": hf_byte_level}


def generate(tokenizer, compiler: GrammarCompiler, spec: GrammarSpec, seed: int, max_steps: int = 300) -> tuple[str, bool]:
    """Sample at temperature 1 from random logits through the grammar; (text, ended on its own)."""
    stops = set(tokenizer.stop_token_ids)
    sampler = Sampler()
    seq = Sequence(0, "r", [1], 1, SamplingParams(temperature=1.0, seed=seed, grammar=spec))
    seq.stop_token_ids = frozenset(stops)  # as Scheduler.add sets them
    seq.grammar = compiler.new_state(compiler.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        result = sampler.sample(torch.randn(1, compiler.vocab_size, generator=generator) * 4, [seq])
        assert not result.errors, result.errors
        token = result.token_ids[0]
        assert seq.grammar.accept(token), seq.grammar.error
        if token in stops:
            return tokenizer.decode(seq.output_token_ids[:-1]), True
        seq.token_ids.append(token)
        if seq.grammar.terminated:
            return tokenizer.decode(seq.output_token_ids), True
    return tokenizer.decode(seq.output_token_ids), False


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_masks_make_random_logits_follow_the_grammar(kind):
    tokenizer = TOKENIZERS[kind]()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    for seed in range(6):
        text, ended = generate(tokenizer, compiler, JSON_SPEC, seed)
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMA)
        text, ended = generate(tokenizer, compiler, GrammarSpec("regex", REGEX), seed)
        assert ended and re.fullmatch(REGEX, text), text
        text, _ = generate(tokenizer, compiler, GrammarSpec("choice", json.dumps(["yes", "no way"])), seed)
        assert text in ("yes", "no way")


def test_unconstrained_rows_are_untouched():
    tokenizer = real_llama3()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    sampler = Sampler()
    logits = torch.randn(3, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    free = [Sequence(i, f"f{i}", [1], 1, SamplingParams(temperature=1.0, seed=i, logprobs=2)) for i in range(2)]
    constrained = Sequence(9, "c", [1], 1, SamplingParams(temperature=1.0, seed=5, grammar=JSON_SPEC))
    constrained.grammar = compiler.new_state(compiler.compile(JSON_SPEC))
    alone = sampler.sample(logits[:2].clone(), free)
    mixed = sampler.sample(torch.cat([logits[:1], logits[2:], logits[1:2]]).clone(), [free[0], constrained, free[1]])
    assert [mixed.token_ids[0], mixed.token_ids[2]] == alone.token_ids
    assert [mixed.logprobs[0], mixed.logprobs[2]] == alone.logprobs
    assert tokenizer.decode([mixed.token_ids[1]]).startswith("{")  # how a JSON object starts: no blanks first


# --------------------------------------------------------------------------- the engine
class RandomLogitsRunner(FakeRunner):
    """FakeRunner's simulated paged KV cache, with logits that are a function of the context
    (read back through the block table) sampled by the real Sampler, masks included."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        super().__init__(num_blocks, block_size)
        self.sampler = Sampler()

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.num_steps += 1
        rows, seqs = [], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            context = self._compute(seq, num_new)
            if batch.samples(i):
                seed = zlib.crc32(bytes(t % 256 for t in context))
                rows.append(torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed)) * 3)
                seqs.append(seq)
        out = StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
        if seqs:
            result = self.sampler.sample(torch.stack(rows), seqs)
            out.errors = result.errors
            for seq, token in zip(seqs, result.token_ids):
                if seq.seq_id not in result.errors:
                    out.seq_ids.append(seq.seq_id)
                    out.sampled_token_ids.append(token)
                    out.logprobs.append(None)
        return out


TOK = FakeTokenizer()
WORDS = GrammarSpec("regex", r"(abc|ab|b)( (abc|ab|b)){5,7}")


def engine(num_blocks: int) -> EngineCore:
    config = EngineConfig(max_num_batched_tokens=32, max_batch_size=8, max_prefill_chunk_tokens=0)
    return EngineCore(RandomLogitsRunner(num_blocks), TOK, config, 64)


def texts(core: EngineCore, requests: list[EngineRequest]) -> dict[str, tuple[str, str]]:
    for req in requests:
        core.add_request(req)
    outputs = run(core)
    assert core.runner.violations == [] and core.pool.num_free == core.pool.num_blocks
    return {rid: ("".join(o.text_delta for o in outs), outs[-1].finish_reason) for rid, outs in outputs.items()}


def constrained(rid: str, seed: int, **params) -> EngineRequest:
    params = {"temperature": 1.0, "max_tokens": 40, "grammar": WORDS, **params}
    return EngineRequest(rid, TOK.encode("ab ab"), SamplingParams(seed=seed, **params))


def test_preemption_prefix_hits_and_choices_keep_their_own_matchers():
    requests = [constrained(f"r{i}", seed=i) for i in range(6)]
    roomy = texts(engine(64), requests)
    tight_core = engine(14)  # 6 sequences of up to ~30 tokens in 14 blocks of 4: preemption
    tight = texts(tight_core, [constrained(f"r{i}", seed=i) for i in range(6)])
    assert tight_core.scheduler.num_preempted_total > 0
    assert tight == roomy
    for text, reason in roomy.values():
        assert reason == "stop" and re.fullmatch(WORDS.source, text), text
    assert len({text for text, _ in roomy.values()}) > 1  # each choice sampled on its own
    again = engine(64)
    texts(again, [constrained("warm", seed=0)])
    assert texts(again, [constrained("hit", seed=0)]) == {"hit": roomy["r0"]}  # through a prefix-cache hit
    assert again.pool.prefix_hits_tokens > 0


def test_out_of_tokens_is_length_with_the_partial_text():
    core = engine(64)
    [(text, reason)] = texts(core, [constrained("short", seed=1, max_tokens=3)]).values()
    assert reason == "length" and len(text) == 3 and re.fullmatch(r"[ab c]+", text)


def test_stop_strings_still_apply():
    core = engine(64)
    [(text, reason)] = texts(core, [constrained("s", seed=2, stop=("b ",))]).values()
    assert reason == "stop" and "b " not in text


# --------------------------------------------------------------------------- compiling
def test_compiled_once_cached_and_bounded():
    compiler = GrammarCompiler(TOK, TOK.vocab_size, sorted(TOK.stop_token_ids), cache_size=2)
    first = compiler.compile(WORDS)
    assert compiler.compile(GrammarSpec("regex", WORDS.source, "other_param")) is first  # param is not part of the key
    compiler.compile(GrammarSpec("regex", "a"))
    compiler.compile(GrammarSpec("regex", "b"))
    assert compiler.compile(WORDS) is not first  # evicted: least recently used


@pytest.mark.parametrize("spec,words", [
    (GrammarSpec("json", '{"type": "strin"}', "guided_json"), "strin"),
    (GrammarSpec("json", '{"if": {"type": "string"}, "then": {"maxLength": 3}}', "guided_json"), '"if"'),
    (GrammarSpec("json", "{nope", "guided_json"), "invalid JSON schema"),
    (GrammarSpec("regex", "(a", "guided_regex"), "unclosed"),
    (GrammarSpec("grammar", "start: foo", "guided_grammar"), "foo"),
])
def test_unenforceable_grammars_are_invalid_requests(spec, words):
    compiler = GrammarCompiler(TOK, TOK.vocab_size, sorted(TOK.stop_token_ids))
    with pytest.raises(InvalidRequest) as caught:
        compiler.compile(spec)
    assert caught.value.param == spec.param and words in str(caught.value)


class GatedCompiles:
    """structured._compile, counted per spec and per thread, each held until `release` is set."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.calls: list[tuple[GrammarSpec, str]] = []
        real = structured._compile

        def gated(spec: GrammarSpec, lltokenizer):
            self.calls.append((spec, threading.current_thread().name))
            self.started.release()
            assert self.release.wait(30), "a test forgot to release the compile"
            return real(spec, lltokenizer)

        monkeypatch.setattr(structured, "_compile", gated)


async def test_a_slow_compile_is_refused_not_waited_for(monkeypatch):
    compiler = GrammarCompiler(TOK, TOK.vocab_size, sorted(TOK.stop_token_ids), compile_timeout_s=0.05)
    gate = GatedCompiles(monkeypatch)
    try:
        with pytest.raises(InvalidRequest) as caught:
            await compiler.prepare(WORDS)
        assert caught.value.code == "grammar_too_complex"
        with pytest.raises(InvalidRequest) as blocking:  # the blocking path has the same bound
            compiler.compile(WORDS)
        assert blocking.value.code == "grammar_too_complex"
    finally:
        gate.release.set()


async def test_concurrent_requests_for_one_spec_share_one_compile(monkeypatch):
    """Issue 29 (9): each request compiled the same spec on its own thread."""
    compiler = GrammarCompiler(TOK, TOK.vocab_size, sorted(TOK.stop_token_ids))
    gate = GatedCompiles(monkeypatch)
    waiters = [asyncio.ensure_future(compiler.prepare(GrammarSpec("regex", WORDS.source, f"p{i}"))) for i in range(3)]
    other = asyncio.ensure_future(compiler.prepare(GrammarSpec("regex", "a+")))
    for _ in range(2):  # both distinct specs reach the compiler; the three equal ones wait for one
        assert await asyncio.to_thread(gate.started.acquire, True, 30)
    assert not any(w.done() for w in waiters)
    gate.release.set()
    compiled = await asyncio.gather(*waiters)
    assert all(c is compiled[0] for c in compiled) and (await other).spec.source == "a+"
    assert sorted(spec.source for spec, _ in gate.calls) == sorted([WORDS.source, "a+"])


def test_a_held_grammar_survives_eviction_and_admission_never_compiles(monkeypatch):
    """Issue 29 (9): a spec evicted between preparation and admission was compiled again on the engine
    thread, with no time limit. Now the request holds what it prepared; admission only copies it."""
    core = engine(64)
    core.grammars.cache_size = 1
    held = core.grammars.compile(WORDS)
    core.grammars.compile(GrammarSpec("regex", "a+"))  # evicts WORDS
    gate = GatedCompiles(monkeypatch)
    gate.release.set()
    core.admit(constrained("held", seed=3), held)
    assert gate.calls == []
    outputs = run(core)
    text = "".join(out.text_delta for out in outputs["held"])
    assert outputs["held"][-1].finish_reason == "stop" and re.fullmatch(WORDS.source, text), text
    with pytest.raises(ValueError, match="prepared grammar"):
        core.admit(constrained("unprepared", seed=3))


async def test_the_async_engine_compiles_off_its_thread_even_with_no_cache(monkeypatch):
    """Issue 29 (9): with the spec evicted before admission, the engine thread compiled it itself."""
    from engine.core.async_engine import AsyncEngine

    config = EngineConfig(max_num_batched_tokens=32, max_batch_size=8, max_prefill_chunk_tokens=0)
    eng = AsyncEngine("fake", RandomLogitsRunner(64), TOK, None, config, max_seq_len=64)
    eng.core.grammars.cache_size = 0  # every compiled grammar is evicted at once
    gate = GatedCompiles(monkeypatch)
    gate.release.set()
    try:
        outputs = [out async for out in eng.generate(constrained("evicted", seed=4))]
    finally:
        await eng.shutdown()
    text = "".join(out.text_delta for out in outputs)
    assert outputs[-1].finish_reason == "stop" and re.fullmatch(WORDS.source, text), text
    assert [name.startswith("grammar-compile") for _, name in gate.calls] == [True]
