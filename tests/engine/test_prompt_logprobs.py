"""Prompt logprobs (SamplingParams.prompt_logprobs) and score-only requests (max_tokens=0).

Over the tiny float64 checkpoint, each prompt token's logprob must equal the log-softmax of a plain
no-cache reference forward at the position before it, however the prompt is chunked, whatever
the prefix cache holds, and however often the request is preempted. The scheduler-level tests use
a fake runner that encodes the position in the logprob, so a duplicated or lost chunk shows.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sequence import ScheduledBatch, StepOutput
from engine.types import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from tests.engine.fakes import ByteTokenizer, FakeRunner
from tests.engine.test_engine_real import MAX_SEQ_LEN, config, make_runner
from tests.engine.test_model import reference_logits
from tests.engine.test_scheduler import Harness

TOK = ByteTokenizer()
TOL = 1e-5  # the model computes in float64 but hands its logits over in float32


@pytest.fixture(scope="module")
def spec(tiny_checkpoint):
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.conftest import TINY_DESCRIPTOR

    return resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)


@pytest.fixture(scope="module")
def state(spec):
    from engine.loading.checkpoint import load_rank_state_dict

    return {k: v.clone() for k, v in load_rank_state_dict(spec, 0, 1).items()}, spec.model_args


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished:
        for out in core.step():
            outputs[out.request_id].append(out)
    assert core.pool.num_free == core.pool.num_blocks
    return outputs


def assert_matches_reference(state, prompt: list[int], got: list[TokenLogprob | None], k: int) -> None:
    full, args = state
    expected = torch.log_softmax(reference_logits(full, args, prompt), dim=1)  # [n, vocab] float64
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        lp = got[pos]
        assert lp is not None and lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(float(expected[pos - 1, prompt[pos]]), abs=TOL)
        values, ids = torch.topk(expected[pos - 1], k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=TOL)


def only_first_has_prompt_logprobs(outs: list[RequestOutput]) -> list[TokenLogprob | None]:
    assert outs[0].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in outs[1:])
    return outs[0].prompt_logprobs


def make_core(spec, **overrides) -> EngineCore:
    cfg = config(spec, **overrides)
    return EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)


# --------------------------------------------------------------------------- the real model
@pytest.mark.parametrize("max_batched", [48, 5])  # one prefill step, or chunks of 5 spread over steps
def test_prompt_logprobs_equal_the_reference_forward(spec, state, max_batched):
    core = make_core(spec, max_num_batched_tokens=max_batched)
    try:
        prompt = prompt_of(13, seed=1)
        params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)
        plain = EngineRequest("plain", prompt, SamplingParams(temperature=0.0, max_tokens=3))
        outs = run(core, [EngineRequest("scored", prompt, params), plain])
        assert_matches_reference(state, prompt, only_first_has_prompt_logprobs(outs["scored"]), k=3)
        assert all(out.prompt_logprobs is None for out in outs["plain"])
        # the generated tokens are those of the same request without prompt logprobs
        assert [t for o in outs["scored"] for t in o.new_token_ids] == [t for o in outs["plain"] for t in o.new_token_ids]
    finally:
        core.runner.shutdown()


def test_prompt_logprobs_after_a_prefix_cached_request(spec, state):
    core = make_core(spec)
    try:
        prompt = prompt_of(18, seed=2)
        run(core, [EngineRequest("warm", prompt, SamplingParams(temperature=0.0, max_tokens=2))])
        hits = core.pool.prefix_hits_tokens
        outs = run(core, [EngineRequest("scored", prompt + [7, 8], SamplingParams(temperature=0.0, max_tokens=2,
                                                                                   prompt_logprobs=0))])
        assert outs["scored"][-1].num_cached_tokens == 0  # the whole prompt was computed
        assert core.pool.prefix_hits_tokens == hits
        assert_matches_reference(state, prompt + [7, 8], only_first_has_prompt_logprobs(outs["scored"]), k=0)
        # its blocks went into the cache for others
        run(core, [EngineRequest("after", prompt + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=1))])
        assert core.pool.prefix_hits_tokens >= hits + 16
    finally:
        core.runner.shutdown()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(spec, state):
    core = make_core(spec, max_num_batched_tokens=6)
    try:
        prompt = prompt_of(11, seed=3)
        outs = run(core, [EngineRequest("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2)),
                          EngineRequest("one", [5], SamplingParams(max_tokens=0, prompt_logprobs=1))])
        (out,) = outs["score"]
        assert out.finish_reason == "length" and out.new_token_ids == [] and out.num_output_tokens == 0
        assert out.num_prompt_tokens == 11
        assert_matches_reference(state, prompt, out.prompt_logprobs, k=2)
        (single,) = outs["one"]
        assert single.prompt_logprobs == [None] and single.finish_reason == "length"
        assert core.stats().prompt_tokens_total == 12
    finally:
        core.runner.shutdown()


def test_preemption_neither_duplicates_nor_loses_prompt_logprobs(spec, state):
    core = make_core(spec, num_blocks=14, max_num_batched_tokens=7)  # too few blocks for all four at once
    try:
        prompts = [prompt_of(9 + 4 * i, seed=10 + i) for i in range(4)]
        requests = [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1))
                    for i, p in enumerate(prompts)]
        outs = run(core, requests)
        assert core.scheduler.num_preempted_total > 0
        for i, prompt in enumerate(prompts):
            assert_matches_reference(state, prompt, only_first_has_prompt_logprobs(outs[f"r{i}"]), k=1)
    finally:
        core.runner.shutdown()


# --------------------------------------------------------------------------- scheduler over a fake runner
class PromptLogprobRunner(FakeRunner):
    """A FakeRunner that also returns prompt logprobs: token p scores -p, so order shows."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        out = super().execute(batch)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.wants_prompt_logprobs:
                c = seq.num_computed_tokens
                out.prompt_logprobs[seq.seq_id] = [
                    TokenLogprob(seq.token_ids[p], -float(p), []) for p in range(c + 1, min(c + num_new + 1, seq.num_prompt_tokens))
                ]
        return out


def expected_fake(prompt: list[int]) -> list[TokenLogprob | None]:
    return [None] + [TokenLogprob(t, -float(p), []) for p, t in enumerate(prompt) if p]


def test_preempted_mid_prefill_starts_prompt_logprobs_over():
    h = Harness(runner=PromptLogprobRunner(64, 4), max_num_batched_tokens=4)
    prompt = list(range(3, 17))
    seq = h.add(prompt, prompt_logprobs=0, max_tokens=3)
    h.step()
    h.step()  # two chunks of four computed
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == 9
    h.sched._preempt(seq)
    assert seq.prompt_logprobs is None and seq.num_computed_tokens == 0
    delivered = []
    for _ in range(50):
        if not h.sched.has_work:
            break
        delivered += [e.prompt_logprobs for e in h.step() if e.prompt_logprobs is not None]
    assert delivered == [expected_fake(prompt)]
    h.assert_clean()


def test_preempted_after_delivery_recomputes_from_cache_without_prompt_logprobs():
    h = Harness(runner=PromptLogprobRunner(64, 4))
    prompt = list(range(3, 15))
    seq = h.add(prompt, prompt_logprobs=0, max_tokens=4)
    (first,) = h.step()
    assert first.prompt_logprobs == expected_fake(prompt) and seq.prompt_logprobs_delivered
    h.sched._preempt(seq)
    (resumed,) = h.step()
    assert resumed.prompt_logprobs is None
    assert h.runner.batches[-1][0][1] < len(prompt) + 1  # the resume hit the prefix cache
    h.run()
    h.assert_clean()


def test_a_runner_that_returns_too_few_prompt_logprobs_fails_the_request():
    h = Harness()  # the plain FakeRunner returns none
    h.add(list(range(3, 10)), prompt_logprobs=1)
    (event,) = h.step()
    assert event.finish_reason == "error" and "prompt logprobs" in event.error
    h.assert_clean()


def test_max_tokens_zero_without_prompt_logprobs_finishes_after_the_prompt():
    h = Harness(max_num_batched_tokens=4)
    h.add(list(range(3, 13)), max_tokens=0)
    h.run()
    assert h.outputs["r0"] == [] and h.finished["r0"].finish_reason == "length"
    h.assert_clean()


def test_merged_deltas_keep_the_prompt_logprobs():
    from engine.core.async_engine import merge_outputs

    prompt = [None, TokenLogprob(5, -1.0, [])]
    first = RequestOutput("r", [7], "a", num_prompt_tokens=2, prompt_logprobs=prompt)
    merged = merge_outputs(merge_outputs(first, RequestOutput("r", [8], "b")), RequestOutput("r", [9], "c"))
    assert merged.prompt_logprobs == prompt and merged.new_token_ids == [7, 8, 9]
