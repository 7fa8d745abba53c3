from __future__ import annotations

import asyncio
import threading

import pytest

from engine.core import engine_core
from engine.core.async_engine import AsyncEngine, merge_outputs
from engine.config import EngineConfig
from engine.core.sequence import ScheduledBatch, StepOutput
from engine.types import (
    ONLINE_PRIORITY,
    ContextLengthExceeded,
    EngineDead,
    EngineRequest,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    SamplingParams,
)
from tests.engine.fakes import FakeRunner, FakeTokenizer, default_next_token

TOK = FakeTokenizer()


class GatedRunner(FakeRunner):
    """A FakeRunner whose steps can be held, to keep requests in flight: `hold()`, then
    `release(n)` lets n more steps run, `open()` lets all run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._permits = threading.Semaphore(0)
        self._held = False

    def hold(self) -> None:
        self._held = True

    def release(self, num_steps: int = 1) -> None:
        self._permits.release(num_steps)

    def open(self) -> None:
        self._held = False
        self._permits.release(1000)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if self._held:
            assert self._permits.acquire(timeout=30), "a test forgot to release the runner"
        return super().execute(batch)


def make_engine(runner: FakeRunner | None = None, *, max_seq_len: int = 128, **config) -> AsyncEngine:
    cfg = EngineConfig(**{"max_num_batched_tokens": 32, "max_batch_size": 8, "max_prefill_chunk_tokens": 0, **config})
    return AsyncEngine("fake", runner or GatedRunner(64, 4), TOK, None, cfg, max_seq_len=max_seq_len)


BATCH = ONLINE_PRIORITY + 1  # what the Batch API runs at (server/batch_runner.py BATCH_PRIORITY)


def request(rid: str, text: str, *, priority: int = ONLINE_PRIORITY, **params) -> EngineRequest:
    params.setdefault("max_tokens", 6)
    return EngineRequest(rid, TOK.encode(text), SamplingParams(**params), priority=priority)


def reference(text: str, n: int) -> list[int]:
    tokens = TOK.encode(text)
    for _ in range(n):
        tokens.append(default_next_token(tokens, TOK.vocab_size))
    return tokens[-n:]


async def collect(engine: AsyncEngine, req: EngineRequest) -> list[RequestOutput]:
    return [out async for out in engine.generate(req)]


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Yield to the loop until the engine thread got somewhere (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def assert_clean(engine: AsyncEngine) -> None:
    await wait_until(lambda: not engine.core.has_unfinished and engine.core.pool.num_free == engine.core.pool.num_blocks)
    assert engine.runner.violations == []
    assert engine.num_running_requests == 0


@pytest.fixture
async def engine():
    eng = make_engine()
    yield eng
    await eng.shutdown()


async def test_concurrent_generate(engine: AsyncEngine):
    texts = {f"r{i}": "abcdefghij"[: 2 + i] for i in range(8)}
    results = await asyncio.gather(*(collect(engine, request(rid, t)) for rid, t in texts.items()))
    for (rid, text), outs in zip(texts.items(), results):
        assert [t for o in outs for t in o.new_token_ids] == reference(text, 6)
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6
    await assert_clean(engine)


async def test_errors_raise_before_anything_is_yielded(engine: AsyncEngine):
    with pytest.raises(InvalidRequest):
        engine.generate(EngineRequest("e", [], SamplingParams()))
    with pytest.raises(ContextLengthExceeded):
        engine.generate(request("c", "a" * 100, max_tokens=100))
    engine.runner.hold()
    gen = engine.generate(request("dup", "abc"))
    first = asyncio.ensure_future(gen.__anext__())
    await wait_until(lambda: engine.core.has_unfinished)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.generate(request("dup", "abc"))
    engine.runner.open()
    assert (await first).new_token_ids
    await gen.aclose()
    await assert_clean(engine)


async def test_a_request_is_checked_once(engine: AsyncEngine, monkeypatch):
    checked: list[str] = []
    check = engine_core.check_request

    def counting(request: EngineRequest, **limits) -> None:
        checked.append(request.request_id)
        check(request, **limits)

    monkeypatch.setattr(engine_core, "check_request", counting)
    outs = await collect(engine, request("once", "abc"))
    assert outs[-1].finish_reason == "length"
    assert checked == ["once"]  # by generate(); not again on the way to the engine thread, nor there
    await assert_clean(engine)


async def run_out_and_shut_down(eng: AsyncEngine, firsts: list[asyncio.Future], gens: list) -> None:
    """Let a held engine run: every queued request yields, closes, and leaves nothing behind."""
    eng.runner.open()
    for first, gen in zip(firsts, gens):
        await first
        await gen.aclose()
    await assert_clean(eng)
    await eng.shutdown()


async def test_queue_full():
    eng = make_engine(max_waiting_requests=2, max_batch_size=1)
    eng.runner.hold()
    gens = [eng.generate(request(f"q{i}", "abc")) for i in range(3)]
    firsts = [asyncio.ensure_future(gens[0].__anext__())]
    sched = eng.core.scheduler
    await wait_until(lambda: sched.num_running == 1)  # q0 runs (held in the runner); q1, q2 will wait
    firsts += [asyncio.ensure_future(g.__anext__()) for g in gens[1:]]
    await wait_until(lambda: eng.num_waiting_sequences(ONLINE_PRIORITY) == 2)
    with pytest.raises(QueueFull):
        eng.generate(request("over", "abc"))
    await run_out_and_shut_down(eng, firsts, gens)


async def test_batch_sequences_never_take_the_online_queue_room():
    """A batch that fills its own bound gets QueueFull (its runner retries); online requests still queue."""
    eng = make_engine(max_waiting_requests=2, max_waiting_batch_sequences=3, max_batch_size=1)
    eng.runner.hold()
    gens = [eng.generate(request("online-0", "abc"))]
    firsts = [asyncio.ensure_future(gens[0].__anext__())]
    await wait_until(lambda: eng.core.scheduler.num_running == 1)  # held in the runner; the rest will wait
    for i in range(3):
        gens.append(eng.generate(request(f"batch-{i}", "abc", priority=BATCH)))
        firsts.append(asyncio.ensure_future(gens[-1].__anext__()))
    await wait_until(lambda: eng.num_waiting_sequences(BATCH) == 3)
    with pytest.raises(QueueFull, match="batch"):
        eng.generate(request("batch-over", "abc", priority=BATCH))
    for i in (1, 2):  # the online queue's whole room is still there
        gens.append(eng.generate(request(f"online-{i}", "abc")))
        firsts.append(asyncio.ensure_future(gens[-1].__anext__()))
    await wait_until(lambda: eng.num_waiting_sequences(ONLINE_PRIORITY) == 2)
    with pytest.raises(QueueFull):
        eng.generate(request("online-over", "abc"))
    await run_out_and_shut_down(eng, firsts, gens)


async def test_early_close_aborts_and_frees_blocks(engine: AsyncEngine):
    engine.runner.hold()
    gen = engine.generate(request("leaver", "abcdef", max_tokens=100))
    first = asyncio.ensure_future(gen.__anext__())
    engine.runner.release(1)
    assert (await first).new_token_ids
    await gen.aclose()  # e.g. the HTTP client disconnected
    engine.runner.open()
    await assert_clean(engine)
    assert engine.stats().requests_finished_total.get("abort") == 1


async def test_cancelled_consumer_aborts(engine: AsyncEngine):
    engine.runner.hold()

    async def consume():
        async for _ in engine.generate(request("cancelled", "abc", max_tokens=100)):
            pass

    task = asyncio.ensure_future(consume())
    await wait_until(lambda: engine.core.has_unfinished)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.runner.open()
    await assert_clean(engine)


async def test_explicit_abort_ends_the_stream(engine: AsyncEngine):
    engine.runner.hold()
    gen = engine.generate(request("ab", "abc", max_tokens=100))
    first = asyncio.ensure_future(gen.__anext__())
    engine.runner.release(1)
    await first
    await engine.abort("ab")
    engine.runner.open()
    outs = [out async for out in gen]
    assert outs[-1].finish_reason == "abort"
    await assert_clean(engine)


async def test_slow_consumer_does_not_block_others(engine: AsyncEngine):
    engine.runner.hold()
    slow = engine.generate(request("slow", "abc", max_tokens=20))
    first = asyncio.ensure_future(slow.__anext__())
    engine.runner.release(1)
    first = await first
    assert len(first.new_token_ids) == 1
    engine.runner.open()
    fast = await collect(engine, request("fast", "xyz", max_tokens=20))  # completes while slow reads nothing
    assert fast[-1].finish_reason == "length"
    slot = engine._active["slow"]
    await wait_until(lambda: bool(slot.pending) and slot.pending[-1].finished)
    rest = [out async for out in slow]
    assert len(rest) == 1  # everything that piled up arrives merged
    assert first.new_token_ids + rest[0].new_token_ids == reference("abc", 20)
    assert rest[0].num_output_tokens == 20 and rest[0].finish_reason == "length"
    assert "".join(o.text_delta for o in [first, *rest]) == TOK.decode(reference("abc", 20))
    await assert_clean(engine)


async def test_stop_string_text(engine: AsyncEngine):
    full = TOK.decode(reference("hello", 8))
    outs = await collect(engine, request("s", "hello", max_tokens=8, stop=(full[4:6],)))
    assert "".join(o.text_delta for o in outs) == full[:4]
    assert outs[-1].finish_reason == "stop"
    await assert_clean(engine)


async def test_per_request_error_and_batch_exception():
    runner = GatedRunner(64, 4, fail_seq=lambda s: "bad" if s.request_id == "bad" else None, raise_on_steps={5})
    eng = make_engine(runner)
    bad, good = await asyncio.gather(collect(eng, request("bad", "abc")), collect(eng, request("good", "abd")))
    assert (bad[-1].finish_reason, bad[-1].error) == ("error", "bad")
    assert good[-1].finish_reason in ("length", "error")
    again = await collect(eng, request("after", "abe"))  # the engine keeps serving
    assert again[-1].finish_reason == "length"
    assert not eng.is_dead
    await assert_clean(eng)
    await eng.shutdown()


async def test_dead_runner_fails_all_and_later_generate_raises():
    eng = make_engine(GatedRunner(64, 4, dead_on_step=3))
    assert not eng.is_dead
    results = await asyncio.gather(
        collect(eng, request("a", "abc", max_tokens=50)), collect(eng, request("b", "abd", max_tokens=50)),
        return_exceptions=True,
    )
    assert all(isinstance(r, EngineDead) for r in results)
    assert eng.core.pool.num_free == eng.core.pool.num_blocks
    assert eng.is_dead  # what the server's registry reads to reload the model
    with pytest.raises(EngineDead):
        eng.generate(request("c", "abc"))
    await eng.shutdown()
    assert eng.runner.shut_down


async def test_shutdown_fails_in_flight_and_stops_runner():
    eng = make_engine()
    eng.runner.hold()
    gen = eng.generate(request("x", "abc", max_tokens=50))
    first = asyncio.ensure_future(gen.__anext__())
    eng.runner.release(1)
    await first
    shutdown = asyncio.ensure_future(eng.shutdown())
    await wait_until(lambda: eng._stopping)
    eng.runner.open()  # the step in flight completes, then the engine stops
    await shutdown
    with pytest.raises(EngineDead):
        async for _ in gen:
            pass
    assert eng.runner.shut_down
    assert eng.core.pool.num_free == eng.core.pool.num_blocks
    with pytest.raises(EngineDead):
        eng.generate(request("y", "abc"))


async def test_stats_and_priority(engine: AsyncEngine):
    await collect(engine, request("a", "abcdefgh"))
    stats = engine.stats()
    assert stats.generation_tokens_total == 6 and stats.prompt_tokens_total == 8
    assert stats.kv_blocks_total == 64 and len(stats.observations_ttft_s) == 1
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_merge_outputs():
    a = RequestOutput("r", [1], "a", None, None, num_output_tokens=1)
    b = RequestOutput("r", [2, 3], "bc", None, "stop", stop_reason="x", num_output_tokens=3)
    m = merge_outputs(a, b)
    assert (m.new_token_ids, m.text_delta, m.finish_reason, m.stop_reason, m.num_output_tokens) == (
        [1, 2, 3], "abc", "stop", "x", 3)


async def test_the_per_request_cap_never_exceeds_a_waiting_bound():
    """A request whose sequences could not all wait would be refused part way every time: compat
    refuses it whole (400) instead, by the engine's cap."""
    engines = [make_engine(), make_engine(max_waiting_requests=8), make_engine(max_waiting_batch_sequences=4)]
    try:
        assert [eng.max_sequences_per_request for eng in engines] == [EngineConfig().max_sequences_per_request, 8, 4]
    finally:
        for eng in engines:
            await eng.shutdown()


async def test_a_mailbox_wakes_its_waiting_consumer_and_survives_one_that_was_cancelled():
    from engine.core.async_engine import _Mailbox  # the slot itself: its waiter is the point here

    slot = _Mailbox(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(slot.get())
    await asyncio.sleep(0)  # it is waiting on the empty box now
    assert slot.waiter is not None and not waiting.done()
    waiting.cancel()  # the client left while its handler waited
    with pytest.raises(asyncio.CancelledError):
        await waiting
    slot.put(RequestOutput("r", [1], "a", num_output_tokens=1))  # the engine's late delta: no error, kept
    assert slot.waiter is None and (await slot.get()).text_delta == "a"
    getter = asyncio.ensure_future(slot.get())
    await asyncio.sleep(0)
    slot.put(RequestOutput("r", [2], "b", num_output_tokens=2))
    slot.put(EngineDead("gone"))  # deltas that came before an error are delivered first
    assert (await getter).text_delta == "b"
    with pytest.raises(EngineDead):
        await slot.get()
