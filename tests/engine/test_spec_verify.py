"""The verifier's rejection sampling (engine/spec/verify.py) keeps the target distribution, and its
target distribution is the sampler's. Statistical, but deterministic: fixed seeds, so the counts are
the same on every run; the bounds are 5 standard deviations of a binomial count (a correct sampler
fails one with probability < 1e-6 per comparison over the seed sets, and these seed sets pass)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.core.sampler import Sampler
from engine.core.sequence import Sequence
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.spec.ngram import NgramIndex, propose_ngram
from engine.spec.speculator import Speculator
from engine.spec.verify import Verifier, target_probs
from engine.types import InvalidRequest, SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.0]], dtype=torch.float32)
NUM_DRAWS = 4000


def within_5_sigma(count: int, n: int, p: float) -> bool:
    sigma = math.sqrt(n * p * (1 - p)) or 0.5
    return abs(count - n * p) <= 5 * sigma


def test_target_probs_by_hand():
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.05)
    probs = target_probs(LOGITS, params)[0]
    # by hand: softmax(x / 0.5); min_p drops p < 0.05 p_max; top_k 4 keeps the ties at the cut (1.0
    # twice); top_p keeps tokens whose strictly heavier mass is < 0.9 of what is left
    p = torch.softmax(LOGITS[0].double() / 0.5, dim=0)
    p = torch.where(p < 0.05 * p.max(), 0.0, p)
    keep = torch.tensor([1, 1, 1, 0, 0, 1], dtype=torch.bool)  # 2.0, 1.0, 0.5, 1.0
    p = torch.where(keep, p, 0.0)
    heavier = torch.tensor([float(p[p > v].sum()) for v in p], dtype=torch.float64)
    p = torch.where(heavier < 0.9 * p.sum(), p, 0.0)
    assert torch.allclose(probs, p / p.sum(), atol=1e-12)
    assert probs[2] == 0  # 0.5 falls outside top_p here, the tie at 1.0 stays
    assert probs[1] == probs[5] > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=3)])
def test_target_probs_is_what_the_sampler_draws(params):
    probs = target_probs(LOGITS, params)[0].tolist()
    sampler = Sampler(seed=0)
    counts = [0] * LOGITS.shape[1]
    for seed in range(NUM_DRAWS):
        seq = Sequence(seq_id=0, request_id="r", token_ids=[1], num_prompt_tokens=1,
                       params=SamplingParams(**{**_fields(params), "seed": seed}))
        counts[sampler.sample(LOGITS, [seq]).token_ids[0]] += 1
    for token, p in enumerate(probs):
        assert within_5_sigma(counts[token], NUM_DRAWS, p), (token, counts, probs)


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in ("temperature", "top_p", "top_k", "min_p")}


@pytest.mark.parametrize("draft", [0, 3, 4])  # the most likely token, an unlikely one, one top_p drops
def test_rejection_sampling_keeps_the_target_distribution(draft):
    params_base = dict(temperature=0.9, top_p=0.97)
    probs = target_probs(LOGITS, SamplingParams(**params_base))[0].tolist()
    verifier = Verifier(seed=0)
    counts = [0] * LOGITS.shape[1]
    accepted = 0
    for seed in range(NUM_DRAWS):
        verdict = verifier.verify(LOGITS, [draft], SamplingParams(**params_base, seed=seed), num_output_tokens=0)
        token = draft if verdict.num_accepted == 1 else verdict.correction
        accepted += verdict.num_accepted
        assert token != draft or verdict.num_accepted == 1  # a correction is never the rejected draft
        counts[token] += 1
    assert within_5_sigma(accepted, NUM_DRAWS, probs[draft])  # accepted with probability p(draft)
    for token, p in enumerate(probs):
        assert within_5_sigma(counts[token], NUM_DRAWS, p), (token, counts, probs)


def test_second_position_is_verified_only_after_the_first_is_accepted():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0]])
    verifier = Verifier(seed=0)
    greedy = SamplingParams(temperature=0.0)
    assert verifier.verify(logits, [1, 2], greedy, 0).num_accepted == 2
    verdict = verifier.verify(logits, [1, 0], greedy, 0)
    assert (verdict.num_accepted, verdict.correction) == (1, 2)
    verdict = verifier.verify(logits, [0, 2], greedy, 0)
    assert (verdict.num_accepted, verdict.correction) == (0, 1)
    seeded = SamplingParams(temperature=1.0, seed=5)
    assert verifier.verify(logits, [0, 2], seeded, 3) == verifier.verify(logits, [0, 2], seeded, 3)  # same seed, same result


# ---------------------------------------------------------------------- prompt lookup
def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    # suffix [1, 2, 3] (3 long) occurred at 0 -> proposes what followed it there
    assert propose_ngram(tokens, 3, lookup_min=1, lookup_max=3) == [4, 9, 2]
    # with at most 2 tokens looked up, [2, 3] last occurred at 5 -> [5, 6]
    assert propose_ngram(tokens, 2, lookup_min=1, lookup_max=2) == [5, 6]
    assert propose_ngram(tokens, 4, lookup_min=4, lookup_max=4) == []  # [9..] no 4-token repeat
    assert propose_ngram([7, 8, 7], 5, lookup_min=1, lookup_max=2) == [8, 7]  # cut at the end
    assert propose_ngram([7], 2, lookup_min=1, lookup_max=2) == []


def scan_ngram(token_ids: list[int], k: int, *, lookup_min: int, lookup_max: int) -> list[int]:
    """The proposer NgramIndex replaced (numpy over the whole token list every step), kept as the
    oracle: vLLM's semantics spelled out directly."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    if k < 1 or len(token_ids) < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, len(token_ids) - 1), lookup_min - 1, -1):
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_proposes_what_a_full_scan_does(seed):
    """Random token lists over small vocabularies (many repeats), grown by 1 to 5 tokens between
    lookups as accepted drafts grow them, every (lookup_min, lookup_max) and k of a few sizes."""
    rng = random.Random(seed)
    lookup_min = rng.randint(1, 3)
    lookup_max = rng.randint(lookup_min, 6)
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
    index = NgramIndex(lookup_min=lookup_min, lookup_max=lookup_max)
    proposed = 0
    for _ in range(150):
        k = rng.choice([0, 1, 4, 7])
        got = index.propose(tokens, k)
        assert got == scan_ngram(tokens, k, lookup_min=lookup_min, lookup_max=lookup_max), (tokens, k)
        proposed += bool(got)
        tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    assert proposed > 10


def test_speculator_keeps_an_index_per_running_sequence():
    spec = Speculator(SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1), max_seq_len=64)
    greedy = SamplingParams(temperature=0.0)
    a = Sequence(0, "a", [1, 2, 3, 1, 2], 5, greedy, num_computed_tokens=4)
    b = Sequence(1, "b", [7, 8, 7], 3, greedy, num_computed_tokens=2)
    for seq in (a, b):
        seq.status = seq.status.RUNNING
    spec.propose([a, b])
    assert (a.spec_token_ids, b.spec_token_ids) == ([3, 1, 2], [8, 7])
    a.token_ids += [3, 9]  # accepted 3, then 9: [9] never seen before
    a.num_computed_tokens = 6
    spec.propose([a, b])
    assert a.spec_token_ids == []
    spec.retain([a])  # b finished: its index goes
    assert set(spec._ngrams) == {0}  # noqa: SLF001 (the test's view of the proposer's state)


# ---------------------------------------------------------------------- configuration
def test_config_as_vllm_spells_it():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert cfg == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)
    cfg = parse_speculative_config({"model": "small", "num_speculative_tokens": 3})
    assert cfg == SpeculativeConfig("draft_model", 3, model="small")
    assert parse_speculative_config(cfg.as_dict()) == cfg
    assert parse_speculative_config(None) is None and parse_speculative_config("{}") is None


@pytest.mark.parametrize("value, param, words", [
    ("{not json", "speculative_config", "not valid JSON"),
    ("[1]", "speculative_config", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method", "not supported"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens", "required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "[1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min", "above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead", "unknown"),
    ({"num_speculative_tokens": 2}, "speculative_config.method", "needs a method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model", "registered model"),
])
def test_bad_config_names_the_field(value, param, words):
    with pytest.raises(InvalidRequest) as caught:
        parse_speculative_config(value)
    assert caught.value.param == param
    assert words in str(caught.value)


def test_tokenizer_difference_names_what_differs():
    from engine.loader import tokenizer_difference
    from tests.engine.fakes import ByteTokenizer

    class Shifted(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            return super().token_bytes(token_id ^ 1 if token_id == 200 else token_id)

    class Bigger(ByteTokenizer):
        vocab_size = 300

    class WithEos(ByteTokenizer):
        stop_token_ids = frozenset({0})

    assert tokenizer_difference(ByteTokenizer(), ByteTokenizer()) is None
    assert tokenizer_difference(ByteTokenizer(), Shifted()) == "token 200 differs"
    assert "300 tokens" in tokenizer_difference(ByteTokenizer(), Bigger())
    assert tokenizer_difference(ByteTokenizer(), WithEos()) == "its stop tokens differ"
