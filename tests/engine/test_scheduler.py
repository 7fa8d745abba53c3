from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.kv_blocks import BlockPool
from engine.core.scheduler import Scheduler, SeqEvent
from engine.core.sequence import Sequence, SequenceStatus
from engine.types import QueueFull, SamplingParams
from tests.engine.fakes import EOS, FakeRunner, FakeTokenizer, default_next_token

BS = 4


class Harness:
    """A scheduler over a FakeRunner, stepped by hand."""

    def __init__(self, num_blocks: int = 64, *, max_seq_len: int = 256, runner: FakeRunner | None = None, **config):
        self.runner = runner or FakeRunner(num_blocks, BS)
        self.pool = BlockPool(self.runner.num_blocks, BS, enable_prefix_caching=config.pop("prefix", True))
        cfg = EngineConfig(**{"max_num_batched_tokens": 64, "max_batch_size": 8, "max_prefill_chunk_tokens": 0, **config})
        self.sched = Scheduler(cfg, self.pool, max_seq_len=max_seq_len, stop_token_ids=FakeTokenizer.stop_token_ids)
        self.next_id = 0
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, SeqEvent] = {}

    def add(self, prompt: list[int], *, rid: str | None = None, priority: int = 0, **params) -> Sequence:
        params.setdefault("max_tokens", 5)
        rid = rid or f"r{self.next_id}"
        seq = Sequence(self.next_id, rid, list(prompt), len(prompt), SamplingParams(**params),
                       arrival_time_s=float(self.next_id), priority=priority)
        self.next_id += 1
        self.sched.add(seq)
        self.outputs[rid] = []
        return seq

    def step(self) -> list[SeqEvent]:
        return self.execute(self.sched.schedule())

    def execute(self, batch) -> list[SeqEvent]:
        if not batch.seqs:
            return []
        out = self.runner.execute(batch)
        events = self.sched.update(batch, out)
        for event in events:
            if event.new_token_id is not None:
                self.outputs[event.seq.request_id].append(event.new_token_id)
            if event.finish_reason is not None:
                self.finished[event.seq.request_id] = event
        return events

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.sched.has_work:
                break
            self.step()
        assert not self.sched.has_work, "did not finish"
        return self.outputs

    def assert_clean(self) -> None:
        assert self.runner.violations == []
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0
        assert self.pool.num_free == self.pool.num_blocks


def prompt(n: int, start: int = 3) -> list[int]:
    return [3 + (start + i) % 60 for i in range(n)]


def reference(prompt_ids: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(max_tokens):
        tokens.append(default_next_token(tokens, FakeTokenizer.vocab_size))
    return tokens[len(prompt_ids):]


def test_single_request_matches_reference():
    h = Harness()
    h.add(prompt(7), max_tokens=6)
    assert h.run()["r0"] == reference(prompt(7), 6)
    assert h.finished["r0"].finish_reason == "length"
    h.assert_clean()


def test_chunked_prefill_never_stalls_decodes():
    h = Harness(max_num_batched_tokens=8)
    a = h.add(prompt(3), max_tokens=10)
    h.step()  # a: prefill of 3, samples
    b = h.add(prompt(30, 10), max_tokens=2)
    batch = h.sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("r0", 1), ("r1", 7)]
    h.execute(batch)
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0  # a partial chunk samples nothing
    for _ in range(3):
        batch = h.sched.schedule()
        assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1  # the decode comes first every step
        assert batch.num_tokens <= 8
        h.execute(batch)
    out = h.run()
    assert out["r0"] == reference(prompt(3), 10)
    assert out["r1"] == reference(prompt(30, 10), 2)
    h.assert_clean()


def test_a_lone_prompt_chunk_may_run_past_the_budget():
    """A prompt chunk that a step runs alone (nothing decoding, no prompt before it) takes up to
    max_prefill_chunk_tokens; with decodes running, or behind another prompt, the budget holds."""
    h = Harness(max_num_batched_tokens=8, max_prefill_chunk_tokens=32)
    a = h.add(prompt(40), max_tokens=3)
    batch = h.sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("r0", 32)]
    h.execute(batch)
    batch = h.sched.schedule()  # still alone: the rest of it, whatever the budget
    assert batch.seqs == [a] and batch.num_new_tokens == [8]
    h.execute(batch)
    h.add(prompt(30, 7), max_tokens=2)
    batch = h.sched.schedule()  # a decodes: the new prompt keeps to the budget
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("r0", 1), ("r1", 7)]
    h.execute(batch)
    out = h.run()
    assert out == {"r0": reference(prompt(40), 3), "r1": reference(prompt(30, 7), 2)}
    h.assert_clean()


def test_prompts_behind_a_lone_chunk_share_the_budget_left():
    """Short prompts arriving together: the first is whole, the others take what the budget leaves."""
    h = Harness(max_num_batched_tokens=8, max_prefill_chunk_tokens=32)
    for i in range(3):
        h.add(prompt(6, i), max_tokens=2)
    batch = h.sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("r0", 6), ("r1", 2)]


def test_a_prompt_with_prompt_logprobs_keeps_to_the_budget():
    """Every row of its chunks gets full-vocabulary logits: the budget bounds that memory, alone or not."""
    h = Harness(max_num_batched_tokens=8, max_prefill_chunk_tokens=32)
    h.add(prompt(30), max_tokens=2, prompt_logprobs=0)
    assert h.sched.schedule().num_new_tokens == [8]


def test_no_chunk_past_the_budget_when_turned_off():
    h = Harness(max_num_batched_tokens=8, max_prefill_chunk_tokens=0)
    h.add(prompt(30), max_tokens=2)
    assert h.sched.schedule().num_new_tokens == [8]


def test_budget_and_batch_size_caps():
    h = Harness(max_num_batched_tokens=10, max_batch_size=2)
    for i in range(3):
        h.add(prompt(4, i), max_tokens=3)
    batch = h.sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    h.execute(batch)
    out = h.run()
    for i in range(3):
        assert out[f"r{i}"] == reference(prompt(4, i), 3)
    h.assert_clean()


def test_admission_waits_until_the_whole_prompt_fits():
    h = Harness(num_blocks=6, max_seq_len=24)
    h.add(prompt(14), max_tokens=2)  # 4 blocks
    h.add(prompt(12, 5), max_tokens=2)  # 3 more blocks needed: only 2 left
    batch = h.sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0"]
    assert h.sched.num_waiting == 1
    out = h.run()
    assert out["r1"] == reference(prompt(12, 5), 2)
    assert h.sched.num_preempted_total == 0
    h.assert_clean()


def run_many(num_blocks: int, specs: list[tuple[int, int, int]], **config) -> tuple[dict[str, list[int]], Harness]:
    h = Harness(num_blocks=num_blocks, max_seq_len=num_blocks * BS, **config)
    for length, start, max_tokens in specs:
        h.add(prompt(length, start), max_tokens=max_tokens)
    out = h.run()
    h.assert_clean()
    return out, h


SPECS = [(5, 0, 12), (9, 3, 7), (3, 11, 15), (13, 20, 4), (6, 2, 10), (8, 40, 9)]


def test_preemption_gives_the_same_tokens_as_an_unconstrained_run():
    unconstrained, _ = run_many(200, SPECS)
    tight, h = run_many(12, SPECS, max_num_batched_tokens=16)
    assert h.sched.num_preempted_total > 0
    assert tight == unconstrained
    for (length, start, max_tokens), rid in zip(SPECS, unconstrained):
        assert unconstrained[rid] == reference(prompt(length, start), max_tokens)


def test_preemption_without_prefix_cache():
    unconstrained, _ = run_many(200, SPECS, prefix=False)
    tight, h = run_many(12, SPECS, prefix=False, max_num_batched_tokens=8)
    assert h.sched.num_preempted_total > 0
    assert tight == unconstrained


def test_preempts_the_newest_running_sequence():
    h = Harness(num_blocks=5, max_seq_len=20)
    old = h.add(prompt(7), max_tokens=12)  # 2 blocks, grows to 5
    new = h.add(prompt(7, 9), max_tokens=12)
    h.step()
    assert h.sched.num_running == 2
    while new.num_preemptions == 0:
        h.step()
        assert old.num_preemptions == 0
    assert new.status is SequenceStatus.PREEMPTED
    assert h.sched.waiting == [new] and new.block_table == []
    out = h.run()
    assert out["r0"] == reference(prompt(7), 12) and out["r1"] == reference(prompt(7, 9), 12)
    h.assert_clean()


def test_prefix_cache_hit_skips_prefill_and_reports_cached_tokens():
    h = Harness()
    system = prompt(12, 30)
    h.add(system + [5, 6], max_tokens=2)
    h.run()
    b = h.add(system + [7, 8, 9], max_tokens=2)
    batch = h.sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [3]  # 12 cached tokens skipped
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    h.execute(batch)
    assert h.run()["r1"] == reference(system + [7, 8, 9], 2)
    assert h.pool.prefix_hits_tokens == 12 and h.pool.prefix_queries_tokens == 14 + 15
    h.assert_clean()


def test_identical_prompt_still_computes_its_last_token():
    h = Harness()
    h.add(prompt(8), max_tokens=1)
    h.run()
    b = h.add(prompt(8), max_tokens=3)
    batch = h.sched.schedule()
    assert batch.num_new_tokens == [4] and b.num_cached_tokens == 4  # last block recomputed
    h.execute(batch)
    assert h.run()["r1"] == reference(prompt(8), 3)
    h.assert_clean()


def test_lru_eviction_makes_room_and_keeps_results_right():
    h = Harness(num_blocks=8, max_seq_len=32)
    for i in range(6):  # each leaves 2 cached blocks behind; the pool cannot keep them all
        h.add(prompt(9, 7 * i), max_tokens=3)
        h.run()
        assert h.outputs[f"r{i}"] == reference(prompt(9, 7 * i), 3)
    assert h.pool.num_evictions > 0
    h.assert_clean()


def test_abort_in_every_phase():
    h = Harness(max_num_batched_tokens=8)
    decoding = h.add(prompt(3), max_tokens=50)
    prefilling = h.add(prompt(30, 5), max_tokens=50)
    h.step()
    h.step()
    waiting = h.add(prompt(4, 9), max_tokens=5)
    assert decoding.num_output_tokens >= 1
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    for seq in (waiting, prefilling, decoding):
        assert h.sched.abort(seq.request_id) is seq
        assert seq.status is SequenceStatus.FINISHED and seq.block_table == []
    done = h.add(prompt(3, 1), max_tokens=1)
    h.run()
    assert h.sched.abort(done.request_id) is None  # after finish: nothing to do
    assert h.sched.abort("never-seen") is None
    h.assert_clean()


def test_abort_preempted_sequence():
    h = Harness(num_blocks=5, max_seq_len=20)
    h.add(prompt(7), max_tokens=12)
    new = h.add(prompt(7, 9), max_tokens=12)
    while new.num_preemptions == 0:
        h.step()
    assert h.sched.abort(new.request_id) is new
    h.run()
    h.assert_clean()


def test_queue_full():
    h = Harness(max_waiting_requests=2)
    h.add(prompt(3))
    h.add(prompt(3))
    with pytest.raises(QueueFull):
        h.add(prompt(3))
    h.run()
    h.add(prompt(3))  # room again once they ran
    h.run()
    h.assert_clean()


def test_fcfs_and_priority_order():
    h = Harness(max_batch_size=1)
    for rid, priority in [("a", 0), ("b", 0), ("urgent", -1), ("later", 5)]:
        h.add(prompt(3), rid=rid, priority=priority, max_tokens=1)
    order = []
    while h.sched.has_work:
        order += [s.request_id for s in h.sched.schedule().seqs if s.num_computed_tokens == 0]
        h.sched.running[0].token_ids.append(9)  # finish it by hand
        h.sched.finish(h.sched.running[0])
    assert order == ["urgent", "a", "b", "later"]
    h.assert_clean()


def test_low_priority_is_preempted_first():
    h = Harness(num_blocks=5, max_seq_len=20)
    low = h.add(prompt(7), max_tokens=12, priority=3)
    high = h.add(prompt(7, 9), max_tokens=12, priority=0)
    while low.num_preemptions == 0:
        h.step()
        assert high.num_preemptions == 0
    h.run()
    h.assert_clean()


def test_per_request_error_fails_only_that_request():
    runner = FakeRunner(64, BS, fail_seq=lambda s: "bad logit_bias" if s.request_id == "r1" else None)
    h = Harness(runner=runner)
    for i in range(3):
        h.add(prompt(5, i), max_tokens=4)
    out = h.run()
    assert h.finished["r1"].finish_reason == "error" and h.finished["r1"].error == "bad logit_bias"
    assert out["r0"] == reference(prompt(5, 0), 4) and out["r2"] == reference(prompt(5, 2), 4)
    h.assert_clean()


def test_batch_failure_frees_the_batch():
    h = Harness()
    h.add(prompt(5), max_tokens=4)
    batch = h.sched.schedule()
    events = h.sched.fail(batch, "boom")
    assert [(e.finish_reason, e.error) for e in events] == [("error", "boom")]
    h.assert_clean()


def eos_after(n: int):
    """A model that emits EOS once the context is n tokens long."""
    def next_token(context: list[int], vocab: int) -> int:
        return EOS if len(context) >= n else default_next_token(context, vocab)
    return next_token


def test_stop_conditions():
    h = Harness(runner=FakeRunner(64, BS, next_token=eos_after(6)), max_seq_len=12)
    h.add(prompt(4), rid="eos", max_tokens=10)
    h.add(prompt(4), rid="ignore", max_tokens=4, ignore_eos=True)
    h.add(prompt(4), rid="min", max_tokens=10, min_tokens=4)
    h.add(prompt(4), rid="ctx", max_tokens=None, ignore_eos=True)
    stop_id = reference(prompt(4), 1)[0]
    h.add(prompt(4), rid="stopid", max_tokens=10, stop_token_ids=(stop_id,))
    out = h.run()
    assert out["eos"][-1] == EOS and len(out["eos"]) == 3
    assert (h.finished["eos"].finish_reason, h.finished["eos"].stop_reason) == ("stop", EOS)
    assert h.finished["ignore"].finish_reason == "length" and len(out["ignore"]) == 4
    # the real sampler masks stop tokens below min_tokens; this fake does not, so the first EOS past it stops
    assert h.finished["min"].finish_reason == "stop" and len(out["min"]) == 5
    assert h.finished["ctx"].finish_reason == "length" and len(out["ctx"]) == 8  # 4 + 8 == max_seq_len
    assert h.finished["stopid"].stop_reason == stop_id and out["stopid"] == [stop_id]
    h.assert_clean()


# --------------------------------------------------------------------------- priority preemption
ONLINE, BATCH = 0, 1


def run_to_reference(h: Harness, expected: dict[str, tuple[list[int], int]]) -> None:
    """Run h dry; every request's output equals the unpreempted reference of its prompt."""
    out = h.run()
    for rid, (prompt_ids, max_tokens) in expected.items():
        assert out[rid] == reference(prompt_ids, max_tokens), rid
    h.assert_clean()


def test_online_arrival_preempts_the_latest_batch_sequence_when_slots_are_full():
    h = Harness(max_batch_size=2)
    first = h.add(prompt(5, 1), rid="b1", priority=BATCH, max_tokens=8)
    second = h.add(prompt(5, 2), rid="b2", priority=BATCH, max_tokens=8)
    h.step()
    h.step()
    online = h.add(prompt(6, 3), rid="online", priority=ONLINE, max_tokens=4)
    batch = h.sched.schedule()
    assert batch.seqs[0] is online and batch.num_new_tokens[0] == 6  # admitted at the next step, first
    assert second.status is SequenceStatus.PREEMPTED and second.num_preemptions == 1
    assert first.status is SequenceStatus.RUNNING and first.num_preemptions == 0
    assert h.sched.num_preempted_total == 1 and h.sched.num_preempted_by_priority == {BATCH: 1}
    h.execute(batch)
    run_to_reference(h, {"b1": (prompt(5, 1), 8), "b2": (prompt(5, 2), 8), "online": (prompt(6, 3), 4)})


def test_online_arrival_preempts_batch_sequences_for_kv_room():
    h = Harness(num_blocks=5, max_seq_len=16)  # the two 8-token prompts hold 4 blocks: 1 is left
    batch_seqs = [h.add(prompt(8, i), rid=f"b{i}", priority=BATCH, max_tokens=4) for i in range(2)]
    h.step()
    online = h.add(prompt(8, 7), rid="online", priority=ONLINE, max_tokens=4)
    batch = h.sched.schedule()
    assert online in batch.seqs
    assert [s.num_preemptions for s in batch_seqs] == [0, 1]  # the latest one, and only as many as needed
    h.execute(batch)
    run_to_reference(h, {"b0": (prompt(8, 0), 4), "b1": (prompt(8, 1), 4), "online": (prompt(8, 7), 4)})


@pytest.mark.parametrize("running_priority, arriving_priority", [(ONLINE, ONLINE), (ONLINE, BATCH), (BATCH, BATCH)])
def test_no_preemption_of_equal_or_more_urgent_sequences(running_priority, arriving_priority):
    h = Harness(max_batch_size=2)
    running = [h.add(prompt(5, i), rid=f"r{i}", priority=running_priority, max_tokens=6) for i in range(2)]
    h.step()
    arriving = h.add(prompt(5, 9), rid="new", priority=arriving_priority, max_tokens=6)
    while arriving.status is SequenceStatus.WAITING:
        assert all(s.num_preemptions == 0 for s in running)
        h.step()
    assert h.sched.num_preempted_total == 0
    run_to_reference(h, {"r0": (prompt(5, 0), 6), "r1": (prompt(5, 1), 6), "new": (prompt(5, 9), 6)})


def test_online_prefill_takes_the_token_budget_before_batch_prefill():
    h = Harness(max_num_batched_tokens=10, max_seq_len=64)
    decoding = h.add(prompt(3, 7), rid="decoding", priority=BATCH, max_tokens=8)
    long_batch = h.add(prompt(40), rid="batch", priority=BATCH, max_tokens=3)
    h.step()  # the short prompt, and 7 of the long one
    h.step()  # a decode, and 9 more of the long prompt
    online = h.add(prompt(12, 5), rid="online", priority=ONLINE, max_tokens=3)
    queued = h.add(prompt(3, 9), rid="queued", priority=BATCH, max_tokens=2)
    batch = h.sched.schedule()
    assert batch.seqs == [online] and batch.num_new_tokens == [10]  # the online chunk first, the whole budget
    h.execute(batch)
    # While the online prompt prefills, batch sequences only decode: no batch prefill chunk and no
    # batch admission lengthens the step that brings its first token.
    batch = h.sched.schedule()
    assert batch.seqs == [online, decoding] and batch.num_new_tokens == [2, 1]
    h.execute(batch)
    batch = h.sched.schedule()  # the online request decodes: batch prefill chunks resume
    assert batch.seqs == [online, decoding, long_batch] and batch.num_new_tokens == [1, 1, 8]
    assert queued.status is SequenceStatus.WAITING and h.sched.num_preempted_total == 0  # budget order only
    h.execute(batch)
    run_to_reference(h, {"batch": (prompt(40), 3), "decoding": (prompt(3, 7), 8), "online": (prompt(12, 5), 3),
                         "queued": (prompt(3, 9), 2)})


def test_no_preemption_when_freeing_every_batch_sequence_would_not_make_room():
    h = Harness(num_blocks=8, max_seq_len=32)
    h.add(prompt(20), rid="online0", priority=ONLINE, max_tokens=4)  # 5 blocks, 6 once it decodes
    small = h.add(prompt(3, 4), rid="batch", priority=BATCH, max_tokens=6)  # 1 block, 3 free
    h.step()
    h.step()  # admitted once online0's prompt is done
    big = h.add(prompt(16, 8), rid="online1", priority=ONLINE, max_tokens=4)  # 4 blocks: 1 free + 1 freeable
    h.step()
    assert small.num_preemptions == 0 and small.status is SequenceStatus.RUNNING
    assert big.status is SequenceStatus.WAITING
    run_to_reference(h, {"online0": (prompt(20), 4), "batch": (prompt(3, 4), 6), "online1": (prompt(16, 8), 4)})


def test_batch_priority_sequences_wait_in_a_bound_of_their_own():
    """Background (batch-priority) sequences never take the online queue's room, nor online theirs."""
    h = Harness(max_waiting_requests=2, max_waiting_batch_sequences=3)
    for _ in range(3):
        h.add(prompt(3), priority=1)
    with pytest.raises(QueueFull, match="batch"):
        h.add(prompt(3), priority=1)
    h.add(prompt(3), priority=0)  # the online queue is untouched by the full batch queue
    h.add(prompt(3), priority=-1)  # more urgent than online counts as online
    with pytest.raises(QueueFull):
        h.add(prompt(3), priority=0)
    assert (h.sched.num_waiting_in("online"), h.sched.num_waiting_in("batch")) == (2, 3)
    h.run()
    assert (h.sched.num_waiting_in("online"), h.sched.num_waiting_in("batch")) == (0, 0)
    h.assert_clean()


def test_preempted_sequences_count_in_their_own_class():
    h = Harness(num_blocks=4, max_seq_len=16, max_batch_size=1)
    batch = h.add(prompt(7), priority=1, max_tokens=8)
    h.step()
    assert (h.sched.num_waiting_in("online"), h.sched.num_waiting_in("batch")) == (0, 0)
    h.add(prompt(7, 9), priority=0, max_tokens=8)
    assert h.sched.num_waiting_in("online") == 1
    h.step()  # the online request preempts the batch sequence: it waits again, in the batch class
    assert batch.num_preemptions == 1
    assert (h.sched.num_waiting_in("online"), h.sched.num_waiting_in("batch")) == (0, 1)
    h.run()
    h.assert_clean()


def test_adapters_beyond_max_loras_wait_their_turn_and_never_starve():
    """max_loras 1: the second adapter's request waits (never fails) while base requests pass; a
    later request of the running adapter does not overtake it."""
    h = Harness(max_loras=1)
    order: list[str] = []

    def add(rid: str, lora_id: int) -> None:
        seq = Sequence(h.next_id, rid, [10, 11, 12], 3, SamplingParams(max_tokens=3), arrival_time_s=float(h.next_id))
        seq.lora_id = lora_id
        h.next_id += 1
        h.sched.add(seq)
        h.outputs[rid] = []

    for rid, lora_id in (("a1", 1), ("b", 2), ("a2", 1), ("base", 0)):
        add(rid, lora_id)
    while h.sched.has_work:
        batch = h.sched.schedule()
        assert len({s.lora_id for s in batch.seqs if s.lora_id}) <= 1
        order += [s.request_id for s in batch.seqs if s.request_id not in order]
        h.execute(batch)
    assert order == ["a1", "base", "b", "a2"]
    assert all(h.finished[rid].finish_reason == "length" for rid in ("a1", "b", "a2", "base"))
    h.assert_clean()
