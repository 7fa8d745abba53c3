"""Speculative decoding (engine/spec/) over a tiny real random checkpoint: greedy output is the output
without speculation, with prompt lookup and with a draft model, batched beside sequences that do not
speculate, under preemption and prefix caching; every KV block comes back. float64 so that the
verification forward's different batch shape cannot flip a near-tied argmax."""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.types import EngineRequest, InvalidRequest, SamplingParams
from tests.engine.fakes import ByteTokenizer

BLOCK_SIZE = 4
MAX_SEQ_LEN = 96
TOK = ByteTokenizer()
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)


@pytest.fixture(scope="module")
def spec(tiny_checkpoint):
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.conftest import TINY_DESCRIPTOR

    return resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)


def config(spec, *, num_blocks: int = 128, **overrides) -> EngineConfig:
    import torch

    from engine.models.llama import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(spec.model_args, 1, BLOCK_SIZE, torch.float64)
    base = dict(dtype="float64", block_size_tokens=BLOCK_SIZE, max_batch_size=8, max_num_batched_tokens=48, max_prefill_chunk_tokens=0,
                kv_cache_bytes=num_blocks * per_block)
    return EngineConfig(**{**base, **overrides})


def make_runner(spec, cfg: EngineConfig):
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup

    return ModelExecutor(WorkerGroup(spec, cfg, max_seq_len=MAX_SEQ_LEN), seed=cfg.seed)


def make_core(spec, cfg: EngineConfig, draft_spec=None) -> EngineCore:
    draft = None
    if draft_spec is not None:
        from engine.loader import draft_config

        draft = make_runner(draft_spec, draft_config(cfg))  # as the loader builds it
    return EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN, draft_runner=draft)


def repeating_requests(n: int, *, prompt_seed: int = 7, **params) -> list[EngineRequest]:
    """Prompts that quote themselves (a phrase repeated), so prompt lookup finds proposals."""
    rng = random.Random(prompt_seed)
    requests = []
    for i in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randint(5, 9))]
        prompt = phrase * rng.randint(2, 4) + phrase[: rng.randint(1, 4)]
        sampling = dict(temperature=0.0, max_tokens=rng.randint(20, 40)) | params
        requests.append(EngineRequest(f"r{i}", prompt, SamplingParams(**sampling)))
    return requests


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    usage: dict[str, int] = {}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                usage[out.request_id] = out.num_output_tokens
    assert core.pool.num_free == core.pool.num_blocks  # rejected drafts' blocks came back too
    assert usage == {rid: len(t) for rid, t in tokens.items()}
    return tokens


@pytest.fixture(scope="module")
def reference(spec):
    """The greedy tokens of each request alone, without speculation."""
    cfg = config(spec, enable_prefix_caching=False)
    core = make_core(spec, cfg)
    cache: dict[tuple, list[int]] = {}

    def tokens_of(request: EngineRequest) -> list[int]:
        key = (tuple(request.prompt_token_ids), request.params)
        if key not in cache:
            cache[key] = run(core, [dataclasses.replace(request, request_id="ref")])["ref"]
        return cache[key]

    return tokens_of


def test_ngram_greedy_identical_with_accepts_and_rejects(spec, reference):
    requests = repeating_requests(6)
    core = make_core(spec, config(spec, speculative_config=NGRAM))
    got = run(core, requests)
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0  # proposals were accepted ...
    assert stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total  # ... and rejected
    assert stats.spec_decode_num_drafts_total > 0
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 4 and sum(per_pos) == stats.spec_decode_num_accepted_tokens_total
    assert per_pos == sorted(per_pos, reverse=True)  # position j is accepted only after 0..j-1


def test_ngram_beside_non_speculating_sequences_with_preemption_and_prefix_cache(spec, reference):
    # logprobs and penalties skip speculation; they share every step with speculating sequences
    requests = repeating_requests(6, prompt_seed=11)
    requests[1] = dataclasses.replace(requests[1], params=dataclasses.replace(requests[1].params, logprobs=2))
    requests[3] = dataclasses.replace(requests[3], params=dataclasses.replace(requests[3].params, presence_penalty=0.5))
    requests.append(dataclasses.replace(requests[0], request_id="dup"))  # a prefix-cache hit on r0's prompt
    cfg = config(spec, speculative_config=NGRAM, num_blocks=40, enable_prefix_caching=True)  # too few: preemption
    core = make_core(spec, cfg)
    got = run(core, requests)
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    assert core.scheduler.num_preempted_total > 0
    assert core.pool.prefix_hits_tokens > 0
    stats = core.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total


def test_draft_model_same_checkpoint_accepts_everything(spec, reference):
    requests = repeating_requests(4, prompt_seed=3)
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 3, model="tiny"))
    core = make_core(spec, cfg, draft_spec=spec)
    got = run(core, requests)
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    stats = core.stats()
    assert stats.spec_decode_num_draft_tokens_total > 0
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total
    assert core.speculator.draft.pool.num_free == core.speculator.draft.pool.num_blocks  # mirrors dropped


def test_draft_model_other_weights_mostly_rejected(spec, reference, tmp_path, tiny_model_args):
    import torch

    from engine.loading.checkpoint import resolve_checkpoint, write_random_checkpoint
    from tests.conftest import TINY_DESCRIPTOR

    other = write_random_checkpoint(tmp_path / "draft", tiny_model_args, num_shards=1, seed=99, dtype=torch.float32)
    draft_spec = resolve_checkpoint(other, model_id="draft", llama_model=TINY_DESCRIPTOR)
    requests = repeating_requests(4, prompt_seed=5)
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 4, model="draft"))
    core = make_core(spec, cfg, draft_spec=draft_spec)
    got = run(core, requests)
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total / 2


def test_draft_model_with_another_vocabulary_is_refused(spec, tmp_path, tiny_model_args):
    import torch

    from engine.loading.checkpoint import resolve_checkpoint, write_random_checkpoint
    from tests.conftest import TINY_DESCRIPTOR

    args = dataclasses.replace(tiny_model_args, vocab_size=320)
    other = write_random_checkpoint(tmp_path / "draft", args, num_shards=1, seed=1, dtype=torch.float32)
    draft_spec = resolve_checkpoint(other, model_id="draft", llama_model=TINY_DESCRIPTOR)
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 2, model="draft"))
    with pytest.raises(InvalidRequest, match="same tokenizer") as caught:
        make_core(spec, cfg, draft_spec=draft_spec)
    assert caught.value.param == "speculative_config.model"


def test_stop_token_and_max_tokens_inside_an_accepted_run(spec, reference):
    """The draft model is the target: every draft is accepted, so a stop token or max_tokens falls
    inside an accepted run and the rest of it is dropped."""
    base = repeating_requests(1, prompt_seed=3)[0]
    full = reference(base)
    stop_at = full[5]
    stop = dataclasses.replace(base, request_id="stop", params=dataclasses.replace(base.params, stop_token_ids=frozenset({stop_at})))
    short = dataclasses.replace(base, request_id="short", params=dataclasses.replace(base.params, max_tokens=6))
    text = TOK.decode(full)
    stop_string = TOK.decode(full[7:9])
    assert stop_string and text.index(stop_string) > 0
    stopped_by_text = dataclasses.replace(base, request_id="text", params=dataclasses.replace(base.params, stop=(stop_string,)))
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 4, model="tiny"))
    core = make_core(spec, cfg, draft_spec=spec)
    without = make_core(spec, config(spec))
    got = run(core, [stop, short, stopped_by_text])  # run() checks usage counts every token delivered
    assert got["stop"] == full[: full.index(stop_at) + 1]
    assert got["short"] == full[:6]
    assert got["text"] == run(without, [stopped_by_text])["text"]  # the tokens up to the stop string's, not the run's
    assert core.stats().spec_decode_num_accepted_tokens_total > 0


def test_ngram_over_model_parallel_size_2(spec, reference):
    requests = repeating_requests(2, prompt_seed=13)
    core = make_core(spec, config(spec, speculative_config=NGRAM, model_parallel_size=2))
    try:
        got = run(core, requests)
    finally:
        core.runner.shutdown()
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    assert core.stats().spec_decode_num_accepted_tokens_total > 0


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_independent(spec):
    """A seeded request speculates and its tokens depend only on its seed: the same alone and batched.
    (That the accepted tokens follow the target distribution is tests/engine/test_spec_verify.py.)"""
    requests = repeating_requests(4, prompt_seed=17, temperature=0.8, top_p=0.95, seed=1234)
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 3, model="tiny"))
    core = make_core(spec, cfg, draft_spec=spec)
    batched = run(core, requests)
    assert core.stats().spec_decode_num_accepted_tokens_total > 0
    for request in requests[:2]:
        alone = run(core, [dataclasses.replace(request, request_id="alone")])["alone"]
        assert alone == batched[request.request_id]


def test_prompt_logprobs_of_a_prefill_batched_behind_speculating_sequences(spec):
    """Draft rows shift every later sequence's rows in the step: prompt logprobs read the right ones."""
    scored = EngineRequest("scored", list(range(40, 70)), SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))

    def prompt_logprobs(core: EngineCore, before: list[EngineRequest]) -> list:
        for request in before:
            core.add_request(request)
        while before and core.speculator.stats.num_drafts == 0:  # until sequences speculate
            core.step()
        core.add_request(scored)
        got = None
        while core.has_unfinished:
            for out in core.step():
                got = out.prompt_logprobs if out.request_id == "scored" and out.prompt_logprobs else got
        return got

    alone = prompt_logprobs(make_core(spec, config(spec)), [])
    # a draft model proposes at every step (prompt lookup only where the text repeats)
    core = make_core(spec, config(spec, speculative_config=SpeculativeConfig("draft_model", 3, model="tiny")), draft_spec=spec)
    batched = prompt_logprobs(core, repeating_requests(3, prompt_seed=21))
    assert core.speculator.stats.num_draft_tokens > 0
    assert len(batched) == len(alone) == 30
    for a, b in zip(alone[1:], batched[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-9


def test_draft_model_beside_a_model_parallel_target(spec, reference):
    """The draft runs on one rank in rank 0's process, next to an MP=2 target."""
    requests = repeating_requests(2, prompt_seed=13)
    cfg = config(spec, speculative_config=SpeculativeConfig("draft_model", 3, model="tiny"), model_parallel_size=2)
    core = make_core(spec, cfg, draft_spec=spec)
    try:
        got = run(core, requests)
    finally:
        core.runner.shutdown()
        core.shutdown_speculator()
    for request in requests:
        assert got[request.request_id] == reference(request), request.request_id
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total > 0
