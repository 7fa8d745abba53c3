"""The whole engine over a tiny real random checkpoint: batching, chunking, preemption and
prefix-cache hits never change a request's tokens. float64, so that a different batch shape
cannot flip a near-tied argmax."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.core.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.types import EngineRequest, SamplingParams
from tests.engine.fakes import ByteTokenizer

BLOCK_SIZE = 4
MAX_SEQ_LEN = 64
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def spec(tiny_checkpoint):
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.conftest import TINY_DESCRIPTOR

    return resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)


def make_runner(spec, config: EngineConfig):
    from engine.executor.worker_group import WorkerGroup
    from engine.executor.executor import ModelExecutor

    return ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN))


def config(spec, *, num_blocks: int = 256, **overrides) -> EngineConfig:
    import torch

    from engine.models.llama import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(spec.model_args, 1, BLOCK_SIZE, torch.float64)
    base = dict(dtype="float64", block_size_tokens=BLOCK_SIZE, max_batch_size=16, max_num_batched_tokens=48, max_prefill_chunk_tokens=0,
                kv_cache_bytes=num_blocks * per_block)
    return EngineConfig(**{**base, **overrides})


def make_requests(n: int = 16, *, prefix: list[int] = (), seeded: bool = False) -> list[EngineRequest]:
    rng = random.Random(1234)
    requests = []
    for i in range(n):
        prompt = list(prefix) + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        sampling = dict(temperature=0.9, top_p=0.95, seed=100 + i) if seeded else dict(temperature=0.0)
        max_tokens = min(rng.randint(4, 16), MAX_SEQ_LEN - len(prompt))
        requests.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **sampling)))
    return requests


class Alone:
    """The reference: one request at a time, no prefix cache; results remembered per request."""

    def __init__(self, spec) -> None:
        cfg = config(spec, enable_prefix_caching=False)
        self.core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
        self.results: dict[tuple, list[int]] = {}

    def run(self, request: EngineRequest) -> list[int]:
        key = (tuple(request.prompt_token_ids), request.params)
        if key not in self.results:
            self.core.add_request(request)
            tokens: list[int] = []
            while self.core.has_unfinished:
                for out in self.core.step():
                    tokens += out.new_token_ids
            self.results[key] = tokens
        return self.results[key]


@pytest.fixture(scope="module")
def alone_engine(spec):
    alone = Alone(spec)
    yield alone
    alone.core.runner.shutdown()


async def run_concurrently(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    async def one(request: EngineRequest) -> list[int]:
        return [t async for out in engine.generate(request) for t in out.new_token_ids]

    results = await asyncio.gather(*(one(r) for r in requests))
    return {r.request_id: tokens for r, tokens in zip(requests, results)}


async def check_batched_equals_alone(spec, alone_engine, requests, cfg: EngineConfig) -> AsyncEngine:
    expected = {r.request_id: alone_engine.run(r) for r in requests}
    for r in requests:  # fresh requests (arrival times) for the batched run
        r.arrival_time_s = 0.0
    engine = AsyncEngine("tiny", make_runner(spec, cfg), TOK, None, cfg, max_seq_len=MAX_SEQ_LEN)
    try:
        got = await run_concurrently(engine, requests)
        assert got == expected
        assert engine.core.pool.num_free == engine.core.pool.num_blocks
        return engine
    finally:
        await engine.shutdown()


async def test_16_concurrent_greedy_requests_equal_each_alone(spec, alone_engine):
    engine = await check_batched_equals_alone(spec, alone_engine, make_requests(), config(spec))
    assert max(engine.stats().observations_batch_size) > 8  # they really ran together


async def test_with_a_pool_small_enough_to_force_preemption(spec, alone_engine):
    engine = await check_batched_equals_alone(spec, alone_engine, make_requests(), config(spec, num_blocks=20))
    assert engine.core.scheduler.num_preempted_total > 0


async def test_with_prefix_cache_hits(spec, alone_engine):
    prefix = [random.Random(7).randrange(256) for _ in range(17)]
    requests = make_requests(prefix=prefix)
    cfg = config(spec)
    expected = {r.request_id: alone_engine.run(r) for r in requests}
    engine = AsyncEngine("tiny", make_runner(spec, cfg), TOK, None, cfg, max_seq_len=MAX_SEQ_LEN)
    try:
        first = await run_concurrently(engine, requests[:1])  # warms the cache with the shared prefix
        rest = await run_concurrently(engine, requests[1:])
        assert {**first, **rest} == expected
        stats = engine.stats()
        assert stats.prefix_cache_hits_total >= 15 * 16  # 4 full blocks of the prefix, for each later request
    finally:
        await engine.shutdown()


async def test_seeded_sampling_same_alone_or_batched(spec, alone_engine):
    await check_batched_equals_alone(spec, alone_engine, make_requests(seeded=True), config(spec, num_blocks=24))


def test_online_requests_preempt_batch_ones_and_every_output_stays_the_same(spec, alone_engine):
    """Low-priority (batch) requests fill every sequence slot; online requests that arrive mid-way
    preempt some of them; greedy, seeded and biased/penalised requests all end with the tokens they
    get alone: a preempted request resumes where it was (recompute, prefix cache)."""
    rng = random.Random(99)
    kinds = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7),
             dict(temperature=0.0, logit_bias=((65, 4.0), (66, 4.0)), repetition_penalty=1.3, presence_penalty=0.5)]

    def request(rid: str, i: int, priority: int) -> EngineRequest:
        prompt = [rng.randrange(256) for _ in range(rng.randint(5, 20))]
        return EngineRequest(rid, prompt, SamplingParams(max_tokens=16, **kinds[i % len(kinds)]), priority=priority)

    batch_requests = [request(f"batch{i}", i, 1) for i in range(6)]
    online_requests = [request(f"online{i}", i, 0) for i in range(3)]
    expected = {r.request_id: alone_engine.run(r) for r in batch_requests + online_requests}
    cfg = config(spec, max_batch_size=4, enable_prefix_caching=True)
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    try:
        got: dict[str, list[int]] = {rid: [] for rid in expected}
        finished_at: dict[str, int] = {}

        def step(n: int) -> None:
            for out in core.step():
                got[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished_at[out.request_id] = n

        for i, r in enumerate(batch_requests):
            r.arrival_time_s = float(i)
            core.add_request(r)
        for n in range(3):  # the batch holds every slot and is decoding
            step(n)
        assert core.scheduler.num_running == 4
        for i, r in enumerate(online_requests):
            r.arrival_time_s = 100.0 + i
            core.add_request(r)
        step(3)
        online_seqs = [core.scheduler.get(r.request_id) for r in online_requests]
        assert all(s is not None and s.num_computed_tokens > 0 for s in online_seqs)  # admitted at the next step
        n = 4
        while core.has_unfinished:
            step(n)
            n += 1
        assert got == expected
        assert core.scheduler.num_preempted_by_priority.get(1, 0) >= 3 and 0 not in core.scheduler.num_preempted_by_priority
        # the online requests ran at once and finished before the batch did
        assert max(finished_at[r.request_id] for r in online_requests) < max(finished_at.values())
        assert core.pool.num_free == core.pool.num_blocks
    finally:
        core.runner.shutdown()


def test_a_bfloat16_prompt_longer_than_the_step_budget_completes(spec):
    """A prompt in chunks: the chunks before its last sample no row, so the output head gets an
    empty input (on AMX CPUs the tiles' kernel refuses zero rows: the binding must not call it)."""
    cfg = config(spec, dtype="bfloat16", cpu_kernels=True, max_num_batched_tokens=16)
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    core.add_request(EngineRequest("long", [(7 * i) % 256 for i in range(45)], SamplingParams(max_tokens=5, temperature=0.0)))
    tokens, finished = [], []
    while core.has_unfinished:
        for out in core.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
            finished.append(out.finished)
    assert len(tokens) == 5 and finished[-1]
