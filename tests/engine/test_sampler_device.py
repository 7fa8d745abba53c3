"""The sampler's device path (Sampler.sample_on_device, what sample() runs for logits off the CPU)
against the host path on CPU tensors: the same tokens, errors and logprobs over every kind of row,
the same seeded uniforms, the grammar's bitmask unpacked on the device, and no vocabulary-sized
tensor read by the host. The last tests run on a GPU where there is one (.ci/cuda)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from engine.core import sampler as sampler_mod
from engine.core.sampler import Sampler, SampleResult, next_uniform, seeded_state
from engine.core.sequence import Sequence, ending_token_ids
from engine.core.structured import GrammarCompiler
from engine.types import GrammarSpec, SamplingParams
from tests.engine.test_sampler import VOCAB, _one_thread, chunk, known_probs, logits_for, seq  # noqa: F401 (fixtures)
from tests.engine.tokenizer_fixtures import tiny_llama2

FAMILY_STOP = 20  # the family's stop token in these tests (Scheduler.add's stop_token_ids)

# One row of each kind. Unseeded rows draw from the sampler's generator: the two paths consume it in
# the same order, so they match too (not after a non-finite row: see POISONED).
ROWS = {
    "greedy": SamplingParams(temperature=0),
    "greedy-logprobs": SamplingParams(temperature=0, logprobs=3),
    "temperature-unseeded": SamplingParams(temperature=0.8),
    "seeded": SamplingParams(temperature=1.0, seed=11),
    "top-k": SamplingParams(temperature=0.7, top_k=5, seed=3),
    "top-p": SamplingParams(temperature=1.3, top_p=0.6, seed=4),
    "top-p-unseeded-low": SamplingParams(temperature=1.0, top_p=0.3),
    "min-p": SamplingParams(temperature=1.0, min_p=0.05, seed=5),
    "top-k-top-p-min-p": SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.01, seed=6),
    "penalties": SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3, seed=7),
    "greedy-penalties": SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.5),
    "logit-bias": SamplingParams(temperature=1.0, logit_bias=((5, 3.0), (9, -100.0)), seed=8),
    "greedy-bias": SamplingParams(temperature=0, logit_bias=((17, 40.0),)),
    "min-tokens": SamplingParams(temperature=1.0, min_tokens=8, stop_token_ids=(21,), seed=9),
    "allowed-ids": SamplingParams(temperature=0.5, allowed_token_ids=frozenset({3, 5, 9, 40, 63}), seed=10),
    "bad-words": SamplingParams(temperature=0, bad_words_token_ids=((7,), (4, 9, 12), (2, 30))),
    "top-logprobs": SamplingParams(temperature=1.0, top_p=0.9, logprobs=5, seed=12),
    "all-masked": SamplingParams(temperature=0.5, min_tokens=50, allowed_token_ids=frozenset({FAMILY_STOP}), seed=1),
    "bad-bias": SamplingParams(temperature=0, logit_bias=((VOCAB + 3, 1.0),), logprobs=2),
    "infinite-bias": SamplingParams(temperature=1.0, logit_bias=((2, math.inf),), seed=2),
}
SEEDED_OR_GREEDY = [name for name, p in ROWS.items() if p.seed is not None or p.temperature == 0]
MIXES = {
    "every-kind": list(ROWS),
    "every-kind-reversed": list(reversed(ROWS)),
    "plain-greedy": ["greedy"] * 5,  # the all-greedy shortcut
    "sampled-only": ["seeded", "top-p", "top-k", "min-p", "temperature-unseeded", "top-p-unseeded-low"],
    "top-p-only": ["top-p", "top-p-unseeded-low", "top-logprobs", "top-p"],
    "masks-only": ["min-tokens", "allowed-ids", "bad-words", "all-masked", "greedy-bias"],
}


def sequences(names: list[str]) -> list[Sequence]:
    """Rows with outputs long enough for bad words and penalties to bite; stop ids as Scheduler.add sets them."""
    seqs = [seq(ROWS[name], prompt=[1, 2, 3, 4, 4], output=[4, 9, 2, 9, 7]) for name in names]
    for s in seqs:
        s.stop_token_ids = ending_token_ids(s.params, frozenset({FAMILY_STOP}))
    return seqs


def assert_same(device: SampleResult, host: SampleResult) -> None:
    assert device.token_ids == host.token_ids
    assert device.errors == host.errors
    assert len(device.logprobs) == len(host.logprobs)
    for got, want in zip(device.logprobs, host.logprobs):
        if want is None:
            assert got is None
            continue
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) <= 1e-6
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(got.top, want.top))


def run_both(logits: torch.Tensor, seqs: list[Sequence], seed: int) -> tuple[SampleResult, SampleResult]:
    before = logits.clone()
    device = Sampler(seed=seed).sample_on_device(logits, seqs)
    host = Sampler(seed=seed).sample(logits, seqs)
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)  # neither path writes the caller's logits
    return device, host


def advance(seqs: list[Sequence], result: SampleResult) -> None:
    for s, token in zip(seqs, result.token_ids):
        if token >= 0:
            s.token_ids.append(token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
def test_device_path_equals_host_path(mix, dtype, chunk):
    seqs = sequences(MIXES[mix])
    sampled_any = False
    for step in range(6):
        logits = logits_for(len(seqs), seed=100 + step).to(dtype)
        device, host = run_both(logits, seqs, seed=step)
        assert_same(device, host)
        advance(seqs, host)
        sampled_any |= any(t >= 0 for t in host.token_ids)
    assert sampled_any
    if mix == "every-kind":  # the rows meant to fail did, alone
        failed = {MIXES[mix][i] for i, s in enumerate(seqs) if s.seq_id in host.errors}
        assert failed == {"all-masked", "bad-bias", "infinite-bias"}


# rows whose logits hold NaN or +inf fail alone on both paths; only seeded and greedy rows here, as the
# host path skips such a row's draw from the sampler's generator, which the device path cannot know in time
POISONED = [name for name in SEEDED_OR_GREEDY if name not in ("bad-bias",)]


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_rows_fail_alone_on_both_paths(poison, chunk):
    seqs = sequences(POISONED)
    logits = logits_for(len(seqs), seed=3)
    poisoned = [0, 3, 5, len(seqs) - 1]
    for row in poisoned:
        if poison == -math.inf:
            logits[row] = -math.inf  # a row with nothing finite at all
        else:
            logits[row, row % VOCAB] = poison
    device, host = run_both(logits, seqs, seed=0)
    assert_same(device, host)
    assert {seqs[row].seq_id for row in poisoned} <= set(host.errors)
    assert all("non-finite" in host.errors[seqs[row].seq_id] for row in poisoned)


@pytest.mark.parametrize("rounds", [0, 1, 2, 16])
def test_top_p_rejection_rounds_and_sorting_fallback_match(monkeypatch, rounds, chunk):
    """A flat row needs several rounds: with few allowed, many rows take the sort on their next uniform."""
    monkeypatch.setattr(sampler_mod, "_MAX_TOP_P_ROUNDS", rounds)
    row = logits_for(1, seed=11)[0] / 3
    seqs = [seq(SamplingParams(temperature=1.0, top_p=top_p, seed=s)) for s in range(40) for top_p in (0.3, 0.95)]
    device, host = run_both(row.expand(len(seqs), -1).contiguous(), seqs, seed=0)
    assert_same(device, host)
    assert len(set(host.token_ids)) > 5


def test_draws_are_the_ones_before_the_device_path():
    """Golden tokens, taken with the sampler before the device path existed (commit 30c1fd3): seeded
    streams, the sampler's own generator, the two-stage inverse CDF over Llama 3's vocabulary,
    top_p by rejection and top_k, on both paths."""
    logits = torch.randn(8, 128256, generator=torch.Generator().manual_seed(1)) * 3
    kinds = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_p=0.9, seed=2),
             SamplingParams(temperature=0.7, top_k=40, seed=3, logprobs=3), SamplingParams(temperature=1.0)]
    seqs = [seq(kinds[i % 4]) for i in range(8)]
    today = [93299, 64778, 112034, 14882, 91528, 21497, 6838, 52120]
    assert Sampler(seed=0).sample(logits, seqs).token_ids == today
    assert Sampler(seed=0).sample_on_device(logits, seqs).token_ids == today


def test_known_top_p_support_on_the_device_path():
    seqs = [seq(SamplingParams(temperature=1.0, top_p=0.75, seed=s)) for s in range(500)]
    picks = Sampler().sample_on_device(known_probs().expand(len(seqs), -1).contiguous(), seqs).token_ids
    assert set(picks) == {1, 3}  # the smallest set reaching 0.75: 0.5 + 0.3


def test_uniform_streams_are_next_uniform_bit_for_bit():
    states = [0, 1, 2**64 - 1, 2**63, seeded_state(-1, 0), seeded_state(7, 1000)] + [random.Random(3).getrandbits(64) for _ in range(20)]
    streams = sampler_mod.UniformStreams(states, torch.device("cpu"))
    drawn = [streams.next() for _ in range(5)]
    assert all(u.dtype == torch.float64 for u in drawn)
    for row, state in enumerate(states):
        expected = []
        for _ in range(5):
            u, state = next_uniform(state)
            expected.append(u)
        assert [u[row].item() for u in drawn] == expected


def test_dense_penalties_equal_sparse_ones_bit_for_bit():
    logits = logits_for(4) * 2
    logits[2, 4] = -0.0
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(frequency_penalty=-1.5), SamplingParams(repetition_penalty=0.6, presence_penalty=2.0)]
    rows = [(0, seq(params[0], prompt=[4, 4, 63], output=[4, 8, 8, 8, 70, -1])),
            (2, seq(params[1], prompt=[1], output=[4, 4, 5])), (3, seq(params[2], prompt=[9, 10], output=[]))]
    sparse, dense = logits.clone(), logits.clone()
    sampler_mod._apply_penalties(sparse, rows)
    sampler_mod._apply_penalties_dense(dense, rows)
    assert torch.equal(sparse, dense) and not torch.equal(sparse, logits)
    assert torch.equal(dense[1], logits[1])


def test_bitmask_unpacks_on_the_device_as_numpy_does():
    g = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 400, 1000):
        words = (vocab + 31) // 32
        bitmask = g.integers(-(2**31), 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
        bitmask[0] = -1  # every bit, the sign bit included
        bitmask[1] = 0
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
        blocked = sampler_mod._blocked_from_bitmask(torch.from_numpy(bitmask), vocab)
        assert blocked.tolist() == (~allowed).tolist()


def test_grammar_rows_match_with_the_mask_unpacked_on_the_device():
    tokenizer = tiny_llama2()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.stop_token_ids))
    spec = GrammarSpec("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
                       "response_format")
    seqs = [Sequence(i, f"r{i}", [1], 1, params) for i, params in enumerate([
        SamplingParams(temperature=1.0, seed=5, grammar=spec, logprobs=2),
        SamplingParams(temperature=1.0, seed=6),
        SamplingParams(temperature=0, grammar=spec),
        SamplingParams(temperature=0.7, top_p=0.8, seed=7, grammar=spec),
    ])]
    for s in seqs:
        s.stop_token_ids = frozenset(tokenizer.stop_token_ids)
        if s.params.grammar is not None:
            s.grammar = compiler.new_state(compiler.compile(spec))
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        logits = torch.randn(len(seqs), tokenizer.vocab_size, generator=generator) * 4
        device, host = run_both(logits, seqs, seed=step)
        assert_same(device, host)
        assert not host.errors
        for s, token in zip(seqs, host.token_ids):
            if s.grammar is not None and not s.grammar.terminated:
                assert s.grammar.accept(token), s.grammar.error
        advance(seqs, host)
    assert tokenizer.decode(seqs[2].output_token_ids).startswith("{")


# ---------------------------------------------------------------------- what the host reads
class HostReadLog(torch.Tensor):
    """Logits that record every read of tensor data into Python or numpy (tolist, item, numpy,
    cpu, to, bool/float/int conversion) by the tensors derived from them."""

    reads: list[tuple[str, int]]  # set per instance by with_log; ops share the list

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        flat = [b for a in args for b in (a if isinstance(a, (tuple, list)) else (a,))]  # torch.cat takes a list
        log = next((a.reads for a in flat if isinstance(a, HostReadLog) and hasattr(a, "reads")), None)
        name = getattr(func, "__name__", "")
        if name in HOST_READS and log is not None:
            log.append((name, args[0].numel()))
        out = super().__torch_function__(func, types, args, kwargs or {})
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, HostReadLog) and log is not None and not hasattr(t, "reads"):
                t.reads = log
        return out


class OffCpuHostReadLog(HostReadLog):
    """A HostReadLog that reports a device other than the CPU, so Sampler.sample takes the device
    path as it would on CUDA."""

    @property
    def is_cpu(self) -> bool:
        return False


HOST_READS = {"tolist", "item", "numpy", "cpu", "to", "__bool__", "__float__", "__int__", "__index__", "__array__"}


def with_log(logits: torch.Tensor, kind: type[HostReadLog] = OffCpuHostReadLog) -> HostReadLog:
    logged = logits.as_subclass(kind)
    logged.reads = []
    return logged


@pytest.mark.parametrize("mix", MIXES)
def test_device_path_reads_no_vocabulary_sized_tensor(mix):
    seqs = sequences(MIXES[mix])
    vocab = 1000  # far more than the packed result's 3 per row plus the logprobs: a row read would show
    logits = with_log(logits_for(len(seqs), seed=5, vocab=vocab))
    expected = Sampler(seed=0).sample(logits_for(len(seqs), seed=5, vocab=vocab), seqs)
    result = Sampler(seed=0).sample(logits, seqs)  # dispatched to the device path by is_cpu
    assert result.token_ids == expected.token_ids and result.errors == expected.errors
    big = [(name, numel) for name, numel in logits.reads if numel >= vocab]
    assert big == []
    assert {name for name, _ in logits.reads} == {"tolist"}
    rounds = len(logits.reads) - 1  # the packed result, then which top_p rows still draw, per rejection round
    rejecting = sum(1 for name in MIXES[mix] if ROWS[name].top_k == 0 and 0 < ROWS[name].temperature and ROWS[name].top_p < 1)
    assert rounds <= sampler_mod._MAX_TOP_P_ROUNDS and (rounds > 0) == (rejecting > 0)
    assert all(numel <= rejecting for _, numel in logits.reads[:-1])


def test_the_host_read_log_sees_the_host_path_read_the_logits():
    """The log can fail: the host path reads the whole batch into numpy for its greedy argmax."""
    seqs = sequences(["greedy", "seeded", "greedy-logprobs"])
    logits = with_log(logits_for(len(seqs), vocab=1000), HostReadLog)
    Sampler(seed=0).sample(logits, seqs)
    assert any(numel >= 1000 for _, numel in logits.reads)


# ---------------------------------------------------------------------- on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
def test_cuda_device_path_gives_the_cpu_tokens(mix, dtype):
    """Seeded rows, greedy rows and unseeded rows draw the same tokens from the same logits on the
    GPU as on the CPU (float32 sums and exp round differently on the GPU: a uniform within an ULP
    of a boundary could flip a draw; none do at these seeds), logprobs close. bfloat16 logits tie
    often, and top_k orders tied tokens as each device's topk does: there greedy rows only."""
    seqs = sequences(MIXES[mix])
    compared = [i for i, s in enumerate(seqs) if dtype == torch.float32 or s.params.temperature == 0]
    for step in range(4):
        logits = logits_for(len(seqs), seed=200 + step).to(dtype)
        host = Sampler(seed=step).sample(logits, seqs)
        device = Sampler(seed=step).sample(logits.cuda(), seqs)
        assert [device.token_ids[i] for i in compared] == [host.token_ids[i] for i in compared]
        assert device.errors == host.errors
        for got, want in zip([device.logprobs[i] for i in compared], [host.logprobs[i] for i in compared]):
            assert (got is None) == (want is None)
            if want is not None:
                assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
                assert [t for t, _ in got.top] == [t for t, _ in want.top]
        advance(seqs, host)


@cuda
def test_cuda_large_vocabulary_batch_matches_the_cpu():
    """Llama 3's vocabulary at batch 64: the two-stage inverse CDF, top-k and top-p on the GPU."""
    vocab = 128256
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, vocab, generator=g) * 3
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=40, seed=2),
             SamplingParams(temperature=1.0, top_p=0.9, seed=3, logprobs=5)]
    seqs = [seq(kinds[i % 4]) for i in range(64)]
    host = Sampler(seed=0).sample(logits, seqs)
    device = Sampler(seed=0).sample(logits.cuda(), seqs)
    assert device.token_ids == host.token_ids and not device.errors
