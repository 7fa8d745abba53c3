from __future__ import annotations

import logging

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.types import (
    ContextLengthExceeded,
    EngineDead,
    EngineRequest,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    SamplingParams,
)
from tests.engine.fakes import EOS, FakeRunner, FakeTokenizer, default_next_token

TOK = FakeTokenizer()


def make_core(runner: FakeRunner | None = None, *, max_seq_len: int = 128, **config) -> EngineCore:
    cfg = EngineConfig(**{"max_num_batched_tokens": 32, "max_batch_size": 8, "max_prefill_chunk_tokens": 0, **config})
    return EngineCore(runner or FakeRunner(64, 4), TOK, cfg, max_seq_len)


def request(rid: str, prompt: str | list[int], **params) -> EngineRequest:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    params.setdefault("max_tokens", 6)
    return EngineRequest(rid, ids, SamplingParams(**params))


def run(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished:
            break
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not core.has_unfinished
    return outputs


def assert_clean(core: EngineCore) -> None:
    assert core.runner.violations == []  # type: ignore[attr-defined]
    assert core.pool.num_free == core.pool.num_blocks
    assert not core.has_unfinished


def reference(prompt_ids: list[int], n: int) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(n):
        tokens.append(default_next_token(tokens, TOK.vocab_size))
    return tokens[len(prompt_ids):]


def joined(outs: list[RequestOutput]) -> tuple[list[int], str]:
    return [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs)


def test_deltas_counts_and_text():
    core = make_core()
    core.add_request(request("a", "hello", max_tokens=5, logprobs=0))
    outs = run(core)["a"]
    ids, text = joined(outs)
    assert ids == reference(TOK.encode("hello"), 5)
    assert text == TOK.decode(ids)
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert all(o.num_prompt_tokens == 5 and len(o.logprobs) == 1 for o in outs)
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert_clean(core)


def test_admission_limits():
    core = make_core(max_seq_len=16)
    with pytest.raises(InvalidRequest, match="empty"):
        core.add_request(request("e", []))
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 16"):
        core.add_request(request("long", "a" * 16))
    with pytest.raises(ContextLengthExceeded, match="12 in the prompt, 5 for the completion"):
        core.add_request(request("sum", "a" * 12, max_tokens=5))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        core.add_request(request("vocab", [3, 999]))
    with pytest.raises(InvalidRequest, match="top_p"):
        core.add_request(request("params", "abc", top_p=0.0))
    core.add_request(request("clamp", "a" * 12, max_tokens=None))  # None: until the context ends
    outs = run(core)["clamp"]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    assert_clean(core)


def test_max_seq_len_capped_by_pool():
    core = make_core(FakeRunner(4, 4), max_seq_len=1000)
    assert core.max_seq_len == 16


def test_duplicate_request_id_and_queue_full():
    core = make_core(max_waiting_requests=1)
    core.add_request(request("a", "abc"))
    with pytest.raises(InvalidRequest, match="already in use"):
        core.add_request(request("a", "abc"))
    with pytest.raises(QueueFull):
        core.add_request(request("b", "abc"))
    assert list(core.output._requests) == ["a"]  # the refused request left nothing behind
    run(core)
    assert_clean(core)


def test_waiting_batch_work_leaves_the_online_queue_free():
    """Issue 29 (4): batch items that filled the one waiting queue locked online requests out."""
    core = make_core(max_waiting_requests=1, max_batch_size=1)
    batch = [EngineRequest(f"batch-{i}", TOK.encode("abc"), SamplingParams(max_tokens=2), priority=1) for i in range(2)]
    for req in batch:
        core.add_request(req)
    core.add_request(request("online", "abc", max_tokens=2))  # was QueueFull: the batch held the only room
    with pytest.raises(QueueFull):
        core.add_request(request("online-2", "abc"))
    outputs = run(core)
    assert {rid: outs[-1].finish_reason for rid, outs in outputs.items()} == {
        "batch-0": "length", "batch-1": "length", "online": "length"}
    assert_clean(core)


def test_stop_string_truncates_text_and_finishes():
    probe = make_core()
    probe.add_request(request("p", "abc", max_tokens=8))
    full = TOK.decode(joined(run(probe)["p"])[0])
    stop = full[3:5]
    core = make_core()
    core.add_request(request("s", "abc", max_tokens=8, stop=(stop, "never")))
    outs = run(core)["s"]
    ids, text = joined(outs)
    assert text == full[: full.index(stop)]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)
    assert len(ids) == 5  # generation stopped at the token that completed the stop string
    assert_clean(core)


def test_stop_token_is_not_in_the_text_and_held_text_is_flushed():
    runner = FakeRunner(64, 4, next_token=lambda ctx, v: EOS if len(ctx) >= 6 else default_next_token(ctx, v))
    core = make_core(runner)
    core.add_request(request("t", "abc", max_tokens=10, stop=("zzzz",)))
    outs = run(core)["t"]
    ids, text = joined(outs)
    assert ids[-1] == EOS and (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", EOS)
    assert text == TOK.decode(ids[:-1])
    assert_clean(core)


def test_request_error_fails_that_request_alone():
    runner = FakeRunner(64, 4, fail_seq=lambda s: "bad bias" if s.request_id == "bad" else None)
    core = make_core(runner)
    core.add_request(request("bad", "abc"))
    core.add_request(request("good", "abd"))
    outs = run(core)
    assert (outs["bad"][-1].finish_reason, outs["bad"][-1].error) == ("error", "bad bias")
    assert joined(outs["good"])[0] == reference(TOK.encode("abd"), 6)
    assert_clean(core)


def test_runner_exception_fails_the_batch_and_engine_keeps_serving():
    core = make_core(FakeRunner(64, 4, raise_on_steps={2}))
    core.add_request(request("a", "abc"))
    core.add_request(request("b", "abd"))
    outs = run(core)
    for rid in ("a", "b"):
        assert outs[rid][-1].finish_reason == "error" and "fake failure" in outs[rid][-1].error
    core.add_request(request("c", "abe"))
    assert joined(run(core)["c"])[0] == reference(TOK.encode("abe"), 6)
    assert core.stats().requests_finished_total == {"error": 2, "length": 1}
    assert_clean(core)


def test_engine_dead_propagates_and_fail_all_frees_everything():
    core = make_core(FakeRunner(64, 4, dead_on_step=2), max_num_batched_tokens=4)
    core.add_request(request("a", "abcdefgh"))
    core.add_request(request("b", "abc"))
    core.step()
    with pytest.raises(EngineDead):
        core.step()
    outs = core.fail_all("worker died")
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finish_reason == "error" and o.error == "worker died" for o in outs)
    assert_clean(core)


def test_abort_mix_preemption_and_failures_leak_nothing():
    runner = FakeRunner(10, 4, fail_seq=lambda s: "x" if s.request_id == "f" and s.num_output_tokens == 2 else None)
    core = make_core(runner, max_num_batched_tokens=8)
    prompts = {rid: TOK.encode(text) for rid, text in [("a", "abcdef"), ("b", "xyzw"), ("f", "qqq"), ("c", "hello wor"), ("d", "k")]}
    for rid, ids in prompts.items():
        core.add_request(request(rid, ids, max_tokens=12))
    outs: dict[str, list[RequestOutput]] = {}
    for step in range(10_000):
        if not core.has_unfinished:
            break
        if step == 3:
            aborted = core.abort_request("b")
            assert aborted is not None and aborted.finish_reason == "abort"
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    assert core.scheduler.num_preempted_total > 0
    assert outs["f"][-1].finish_reason == "error"
    for rid in ("a", "c", "d"):
        assert joined(outs[rid])[0] == reference(prompts[rid], 12)
    assert core.abort_request("a") is None
    assert_clean(core)


def test_stats_snapshot_and_drain():
    core = make_core()
    system = TOK.encode("the system prompt1")
    core.add_request(request("a", system + TOK.encode("one")))
    run(core)
    core.add_request(request("b", system + TOK.encode("two")))
    outs = run(core)
    assert outs["b"][0].num_cached_tokens == 16
    stats = core.stats()
    assert stats.prompt_tokens_total == 42 and stats.generation_tokens_total == 12
    assert stats.prefix_cache_queries_total == 42 and stats.prefix_cache_hits_total == 16
    assert len(stats.observations_ttft_s) == 2 and len(stats.observations_e2e_s) == 2
    assert len(stats.observations_tpot_s) == 2 and stats.observations_batch_size
    assert stats.kv_blocks_total == 64 and stats.kv_blocks_used == 0
    assert stats.requests_finished_total == {"length": 2}
    again = core.stats()
    assert again.observations_ttft_s == [] and again.prompt_tokens_total == 42
    assert_clean(core)


def test_debug_log_io(caplog):
    core = make_core(debug_log_io=True)
    with caplog.at_level(logging.INFO):
        core.add_request(request("dbg", "hi", max_tokens=2))
        run(core)
    assert "prompt ids=[10, 11]" in caplog.text and "'hi'" in caplog.text
    assert "request dbg finished: length" in caplog.text
    assert_clean(core)


@pytest.mark.parametrize("seed", range(6))
def test_random_mix_of_adds_aborts_and_steps(seed: int):
    """Shared prefixes, a tiny pool, chunking, priorities and aborts at random moments: every request
    that is not aborted gets exactly its reference tokens, and nothing leaks."""
    import random

    rng = random.Random(seed)
    core = make_core(FakeRunner(rng.choice([12, 14, 16]), 4), max_seq_len=48,
                     max_num_batched_tokens=rng.choice([4, 8, 16]), max_batch_size=rng.choice([2, 4, 8]))
    prefixes = [TOK.encode(p) for p in ("system one", "another system", "")]
    prompts: dict[str, list[int]] = {}
    outs: dict[str, list[RequestOutput]] = {}
    aborted: set[str] = set()
    max_tokens: dict[str, int] = {}
    for _ in range(400):
        if len(prompts) < 30 and rng.random() < 0.5:
            rid = f"q{len(prompts)}"
            prompts[rid] = rng.choice(prefixes) + [3 + rng.randrange(60) for _ in range(rng.randint(1, 12))]
            req = request(rid, prompts[rid], max_tokens=rng.randint(1, 10))
            req.priority = rng.choice([0, 0, 1])
            core.add_request(req)
            max_tokens[rid] = req.params.max_tokens  # type: ignore[assignment]
        if prompts and rng.random() < 0.05:
            rid = rng.choice(list(prompts))
            if core.abort_request(rid) is not None:
                aborted.add(rid)
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    run(core)
    for rid, outputs in outs.items():
        if rid not in aborted:
            assert joined(outputs)[0] == reference(prompts[rid], max_tokens[rid])
            assert outputs[-1].finish_reason == "length"
    assert set(outs) | aborted == set(prompts)
    assert_clean(core)


def test_client_priority_overtakes_queued_requests():
    """vLLM's `priority`: with every sequence slot taken, a request with a lower number is admitted
    before higher-numbered ones that queued earlier; equal numbers stay first come, first served."""
    core = make_core(max_batch_size=1)
    admitted: list[str] = []
    core.add_request(request("running", "go", max_tokens=3))
    core.step()  # "running" holds the only slot
    for rid, client_priority in (("late-5", 5), ("late-3", 3), ("first-0", 0), ("second-0", 0), ("urgent", -2)):
        req = request(rid, "hi", max_tokens=1)
        req.client_priority = client_priority
        core.add_request(req)
    while core.has_unfinished:
        for out in core.step():
            if out.num_output_tokens == 1:
                admitted.append(out.request_id)
    assert admitted == ["urgent", "first-0", "second-0", "late-3", "late-5"]
    assert_clean(core)


def test_stats_time_each_phase_of_a_request():
    """Queue, prefill and decode time once per request, and one inter-token gap per token after the first
    (vLLM's request_*_time_seconds and inter_token_latency_seconds)."""
    core = make_core()
    core.add_request(request("a", "hello", max_tokens=4))
    core.add_request(request("b", "hi", max_tokens=1))
    run(core)
    stats = core.stats()
    assert len(stats.observations_queue_s) == len(stats.observations_prefill_s) == 2
    assert len(stats.observations_decode_s) == 2 and len(stats.observations_itl_s) == 3
    assert all(v >= 0 for v in [*stats.observations_queue_s, *stats.observations_prefill_s,
                                *stats.observations_decode_s, *stats.observations_itl_s])
    assert core.stats().observations_itl_s == []  # handed over once
