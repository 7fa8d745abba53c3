"""Sampler: greedy, seeds, truncation supports, penalties, bias, min_tokens, logprobs, row errors."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from engine.core import sampler as sampler_mod
from engine.kernels.cpu import load_cpu_kernels
from engine.core.sampler import Sampler, SampleResult
from engine.core.sequence import Sequence, ending_token_ids
from engine.types import SamplingParams

VOCAB = 64
_ids = itertools.count()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[1024, 5], ids=["one-stage", "two-stage"])
def chunk(request, monkeypatch):
    """Run a test with the whole-row inverse CDF and with the chunked two-stage one (VOCAB = 12 * 5 + 4
    leaves a short last chunk)."""
    monkeypatch.setattr(sampler_mod, "_CHUNK", request.param)
    return request.param


def seq(params: SamplingParams | None = None, prompt: list[int] | None = None, output: list[int] | None = None) -> Sequence:
    prompt = [1, 2, 3] if prompt is None else prompt
    output = output or []
    return Sequence(
        seq_id=next(_ids),
        request_id="r",
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
        params=params or SamplingParams(),
    )


def logits_for(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * 3


@contextlib.contextmanager
def torch_threads(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sample(logits: torch.Tensor, seqs: list[Sequence], *, stop_token_ids: frozenset[int] = frozenset(), kernels=None) -> SampleResult:
    """Sample as the runner does, with each sequence's stop ids set as Scheduler.add sets them."""
    for s in seqs:
        s.stop_token_ids = ending_token_ids(s.params, stop_token_ids)
    return Sampler(seed=1234, kernels=kernels).sample(logits, seqs)


# ---------------------------------------------------------------------- greedy
def test_greedy_is_argmax_on_fast_and_general_paths():
    logits = logits_for(8)
    fast = sample(logits, [seq(SamplingParams(temperature=0)) for _ in range(8)])
    general = sample(logits, [seq(SamplingParams(temperature=0, logprobs=0)) for _ in range(8)])
    assert fast.token_ids == logits.argmax(dim=1).tolist()
    assert general.token_ids == fast.token_ids
    assert fast.errors == {} and general.errors == {}


def test_logits_rows_must_match_sequences():
    with pytest.raises(ValueError, match="3 sequences"):
        sample(logits_for(2), [seq() for _ in range(3)])


def test_empty_batch():
    result = sample(torch.empty(0, VOCAB), [])
    assert (result.token_ids, result.logprobs, result.errors) == ([], [], {})


# ---------------------------------------------------------------------- seeds
SEEDED_VARIANTS = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_k=5, seed=7),
    SamplingParams(temperature=1.3, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.01, seed=7),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, repetition_penalty=1.2, seed=7),
]
OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3, seed=99),
    SamplingParams(temperature=1.0, top_p=0.5, logprobs=3),
    SamplingParams(temperature=1.0, logit_bias=((5, 2.0),), presence_penalty=1.0),
]


@pytest.mark.parametrize("params", SEEDED_VARIANTS)
def test_seed_reproduces_alone_and_in_any_batch(params, chunk):
    outputs = [4, 9, 4]
    alone, batched = [], []
    for step in range(30):
        logits = logits_for(1 + len(OTHERS), seed=step)
        target = seq(params, output=outputs + [step % 7] * step)
        alone.append(sample(logits[2:3].clone(), [target]).token_ids[0])
        others = [seq(p, output=[1, 2]) for p in OTHERS]
        batch = others[:2] + [target] + others[2:]
        batched.append(Sampler(seed=step).sample(logits.clone(), batch).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_seeded_draw_depends_on_step_not_on_prompt_length():
    # after preemption a sequence is recomputed; the draw for output token n must be the same
    logits = logits_for(1)
    params = SamplingParams(temperature=1.0, seed=3)
    a = sample(logits, [seq(params, prompt=[1] * 5, output=[2, 3])])
    b = sample(logits, [seq(params, prompt=[1] * 40, output=[7, 8])])
    assert a.token_ids == b.token_ids
    tokens = {sample(logits, [seq(params, output=[0] * n)]).token_ids[0] for n in range(20)}
    assert len(tokens) > 1


def test_unseeded_rows_follow_the_sampler_seed():
    logits = logits_for(16)
    seqs = [seq(SamplingParams(temperature=1.0)) for _ in range(16)]
    a = Sampler(seed=5).sample(logits, seqs).token_ids
    b = Sampler(seed=5).sample(logits, seqs).token_ids
    c = Sampler(seed=6).sample(logits, seqs).token_ids
    assert a == b and a != c


# ---------------------------------------------------------------------- distribution and supports
def draws(logits_row: torch.Tensor, params: SamplingParams, num: int = 2000) -> list[int]:
    """num draws of one row: one batch of num rows with different seeds."""
    seqs = [seq(SamplingParams(**{**_fields(params), "seed": s})) for s in range(num)]
    result = sample(logits_row.expand(num, -1).contiguous(), seqs)
    assert result.errors == {}
    return result.token_ids


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__slots__}


@pytest.mark.parametrize("vocab", [8, 23])
def test_temperature_one_matches_softmax_frequencies(chunk, vocab):
    row = logits_for(1, vocab=vocab)[0] / 3
    picks = draws(row, SamplingParams(temperature=1.0), num=8000)
    expected = torch.softmax(row, dim=0)
    observed = torch.bincount(torch.tensor(picks), minlength=vocab).double() / len(picks)
    sigma = (expected * (1 - expected) / len(picks)).sqrt()
    assert torch.all((observed - expected).abs() < 5 * sigma + 1e-3)


def test_temperature_sharpens_distribution():
    row = logits_for(1, vocab=8)[0] / 3
    hot = draws(row, SamplingParams(temperature=2.0))
    cold = draws(row, SamplingParams(temperature=0.25))
    best = int(row.argmax())
    assert cold.count(best) > hot.count(best)


def test_top_k_picks_only_the_k_best():
    row = logits_for(1)[0]
    picks = set(draws(row, SamplingParams(temperature=5.0, top_k=4)))
    assert picks == set(row.topk(4).indices.tolist())


def known_probs() -> torch.Tensor:
    probs = torch.tensor([0.05, 0.5, 0.02, 0.3, 0.1, 0.03])
    return torch.cat([probs.log(), torch.full((VOCAB - 6,), -1e4)])


@pytest.mark.parametrize("rounds", [16, 0])  # 0: no rejection rounds, every row takes the sorting fallback
def test_top_p_keeps_smallest_set_reaching_p(monkeypatch, rounds, chunk):
    monkeypatch.setattr(sampler_mod, "_MAX_TOP_P_ROUNDS", rounds)
    row = known_probs()
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.75))) == {1, 3}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.85))) == {1, 3, 4}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.1))) == {1}


def test_top_p_is_relative_to_what_top_k_left():
    row = known_probs()
    # top_k=2 leaves {1: 0.5/0.8 = 0.625, 3: 0.3/0.8}; over the whole row 0.5 < 0.6 needs both
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.6))) == {1, 3}
    assert set(draws(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))) == {1}
    assert set(draws(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.7))) == {1, 3}


def test_min_p_drops_tokens_under_fraction_of_best(chunk):
    row = known_probs()
    # threshold 0.15 * 0.5 = 0.075: keeps 0.5, 0.3, 0.1
    assert set(draws(row, SamplingParams(temperature=1.0, min_p=0.15))) == {1, 3, 4}


def test_top_p_frequencies_are_renormalised(chunk):
    row = known_probs()
    picks = draws(row, SamplingParams(temperature=1.0, top_p=0.75), num=4000)
    share = picks.count(1) / len(picks)
    assert abs(share - 0.5 / 0.8) < 0.04


# ---------------------------------------------------------------------- penalties
def test_penalties_follow_the_formulas():
    logits = logits_for(2)
    prompt, output = [1, 2, 3, 3], [3, 5, 5, 5, 7]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    x = logits.clone()
    sampler_mod._apply_penalties(x, [(1, seq(params, prompt=prompt, output=output))])
    expected = logits.clone()
    row = expected[1]
    for token in set(prompt + output):  # repetition: prompt and output
        row[token] = row[token] / 1.5 if row[token] > 0 else row[token] * 1.5
    for token in set(output):  # OpenAI: output only
        row[token] -= output.count(token) * 0.25 + 0.5
    assert torch.allclose(x, expected, atol=1e-6)
    assert torch.equal(x[0], logits[0])  # other rows untouched


def test_frequency_penalty_moves_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    plain = sample(logits, [seq(SamplingParams(temperature=0), output=[10, 10])])
    penalised = sample(logits, [seq(SamplingParams(temperature=0, frequency_penalty=1.0), output=[10, 10])])
    assert plain.token_ids == [10] and penalised.token_ids == [11]


# ---------------------------------------------------------------------- logit_bias and min_tokens
def test_logit_bias_forces_and_forbids():
    logits = logits_for(3)
    best = logits.argmax(dim=1).tolist()
    second = logits.topk(2, dim=1).indices[:, 1].tolist()
    seqs = [
        seq(SamplingParams(temperature=0, logit_bias=((17, 100.0),))),
        seq(SamplingParams(temperature=1.0, seed=1, logit_bias=((17, 100.0),))),
        seq(SamplingParams(temperature=0, logit_bias=((best[2], -100.0),))),
    ]
    assert sample(logits, seqs).token_ids == [17, 17, second[2]]


def test_bad_logit_bias_fails_its_row_alone():
    logits = logits_for(3)
    seqs = [seq(SamplingParams(temperature=0)), seq(SamplingParams(logit_bias=((VOCAB + 5, 1.0),))), seq(SamplingParams(temperature=0))]
    result = sample(logits, seqs)
    assert set(result.errors) == {seqs[1].seq_id} and "logit_bias" in result.errors[seqs[1].seq_id]
    assert result.token_ids[1] == -1
    assert [result.token_ids[0], result.token_ids[2]] == [logits[0].argmax().item(), logits[2].argmax().item()]


def test_min_tokens_masks_family_and_request_stops():
    family_stop, request_stop = 20, 21
    logits = torch.zeros(5, VOCAB)
    logits[:, family_stop], logits[:, request_stop], logits[:, 30] = 9.0, 8.0, 7.0
    seqs = [
        seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(request_stop,)), output=[1]),
        seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(request_stop,)), output=[1, 2, 3]),
        seq(SamplingParams(temperature=0, min_tokens=3), output=[1]),
        seq(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), output=[1]),
        seq(SamplingParams(temperature=2.0, seed=0, min_tokens=3, stop_token_ids=(request_stop,))),
    ]
    result = sample(logits, seqs, stop_token_ids=frozenset({family_stop}))
    assert result.token_ids[:4] == [30, family_stop, request_stop, family_stop]
    assert result.token_ids[4] not in (family_stop, request_stop)


def test_row_with_every_token_masked_fails_alone():
    logits = logits_for(2, vocab=4)
    seqs = [seq(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(0, 1, 2, 3))), seq(SamplingParams(temperature=0))]
    result = sample(logits, seqs)
    assert list(result.errors) == [seqs[0].seq_id] and result.token_ids[1] == logits[1].argmax().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_is_torch_max_first_best_id_on_views_and_ties(dtype):
    """The greedy path (numpy's argmax for float32 on CPU) picks what torch.max picks: the first of
    tied best ids, on a row-sliced view too (the runner samples logits[:num_sampling])."""
    logits = logits_for(6).to(dtype)
    logits[2, 5] = logits[2, 40] = logits[2].max() + 1  # a tie: id 5 first
    logits[3] = -math.inf
    logits[3, 9] = logits[3, 11] = 0.0
    view = logits[1:5]
    seqs = [seq(SamplingParams(temperature=0)) for _ in range(4)]
    mixed = [*seqs[:3], seq(SamplingParams(temperature=1.0, seed=1))]  # the general path's greedy rows
    expected = view.max(dim=1).indices.tolist()
    assert sample(view, seqs).token_ids == expected and expected[1] == 5 and expected[2] == 9
    assert sample(view, mixed).token_ids[:3] == expected[:3]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_greedy_equals_numpy_argmax_of_float32(threads, dtype):
    """The all-greedy path runs the fused kernels' argmax (bfloat16 without a float32 copy): the same
    ids and row maxima as numpy's argmax of logits.float(), on rows full of ties, +0 against -0,
    infinities, NaN (the first NaN wins) and lengths around the kernel's 16-, 32- and 64-wide steps."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("fused CPU kernels could not be built here; the float32 copy path runs")
    g = torch.Generator().manual_seed(7)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    for vocab in (1, 15, 31, 32, 33, 63, 64, 65, 100, 1000, 4099):
        logits = torch.randint(-3, 3, (40, vocab), generator=g).float()  # few distinct values: ties
        for row in range(0, 40, 3):
            at = torch.randint(0, vocab, (2,), generator=g)
            logits[row, at] = specials[torch.randint(0, 5, (2,), generator=g)]
        logits[1] = -math.inf
        logits[2] = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0)
        logits[4] = torch.where(torch.rand(vocab, generator=g) < 0.5, -2.0, -0.0)
        logits = logits.to(dtype)
        ids, values = kernels.argmax_rows(logits, threads)
        expected_ids, expected_values = sampler_mod._row_max(logits.float())
        assert ids == expected_ids
        assert [v if v == v else "nan" for v in values] == [v if v == v else "nan" for v in expected_values]
        with torch_threads(threads):  # the sampler calls the kernel with torch's thread count
            token_ids = sample(logits, [seq(SamplingParams(temperature=0)) for _ in range(40)], kernels=kernels).token_ids
        assert token_ids == [
            i if math.isfinite(v) else -1 for i, v in zip(expected_ids, expected_values)
        ]


# ---------------------------------------------------------------------- non-finite rows
@pytest.mark.parametrize("other", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9, logprobs=2)])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kernels", [False, True])
def test_non_finite_row_fails_alone(other, poison, dtype, with_kernels):
    kernels = load_cpu_kernels() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("fused CPU kernels could not be built here")
    logits = logits_for(3).to(dtype)
    logits[1, 7] = poison
    seqs = [seq(other), seq(other), seq(other)]
    result = sample(logits, seqs, kernels=kernels)
    assert list(result.errors) == [seqs[1].seq_id] and result.token_ids[1] == -1
    assert all(0 <= result.token_ids[i] < VOCAB for i in (0, 2))


# ---------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = logits_for(3)
    seqs = [
        seq(SamplingParams(temperature=0, logprobs=5)),
        seq(SamplingParams(temperature=0.5, top_k=3, seed=2, logprobs=0, logit_bias=((4, 50.0),))),
        seq(SamplingParams(temperature=0)),
    ]
    result = sample(logits, seqs)
    reference = torch.log_softmax(logits.double(), dim=1)
    first, second = result.logprobs[0], result.logprobs[1]
    assert result.logprobs[2] is None
    assert first.token_id == result.token_ids[0]
    assert first.logprob == pytest.approx(reference[0, first.token_id].item(), abs=1e-5)
    assert [t for t, _ in first.top] == reference[0].topk(5).indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(reference[0].topk(5).values.tolist(), abs=1e-5)
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    # bias forced token 4, but the logprob reported is the raw model's
    assert second.token_id == 4 and second.top == []
    assert second.logprob == pytest.approx(reference[1, 4].item(), abs=1e-5)


def test_seeded_streams_are_uniform_and_distinct():
    values = []
    for seed in (-1, 0, 1, 2**63 + 5):
        for step in range(50):
            u, state = sampler_mod.next_uniform(sampler_mod.seeded_state(seed, step))
            values += [u, sampler_mod.next_uniform(state)[0]]
    assert all(0 <= v < 1 for v in values)
    assert len(set(values)) == len(values)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.95])
def test_top_p_support_matches_sorted_reference_on_a_flat_row(chunk, top_p):
    row = logits_for(1, seed=11)[0] / 3  # many tokens share the mass: several rejection rounds
    probs = torch.softmax(row.double(), dim=0)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    allowed = set(order[before < top_p].tolist())
    picks = draws(row, SamplingParams(temperature=1.0, top_p=top_p), num=3000)
    assert set(picks) <= allowed
    assert len(set(picks)) >= 0.8 * len(allowed)


def test_allowed_token_ids_keep_only_those_tokens():
    logits = logits_for(2)
    allowed = frozenset({5, 9, 40})
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    seqs = [seq(SamplingParams(temperature=0, allowed_token_ids=allowed)),
            seq(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed))]
    assert logits[0].argmax().item() not in allowed  # so the mask is what changes the choice
    result = sample(logits, seqs)
    assert result.token_ids[0] == best_allowed and result.token_ids[1] in allowed
    assert all(t in allowed for t in draws(logits[1], SamplingParams(temperature=1.0, allowed_token_ids=allowed), 200))


def test_bad_words_mask_single_tokens_always_and_sequences_after_their_prefix():
    logits = logits_for(3)
    best = logits.argmax(dim=1).tolist()
    second = logits.topk(2, dim=1).indices[:, 1].tolist()
    words = ((best[0],), (7, 8, best[1]), (7, 8, best[2]))
    seqs = [
        seq(SamplingParams(temperature=0, bad_words_token_ids=words)),  # a one-token word: never
        seq(SamplingParams(temperature=0, bad_words_token_ids=words), output=[3, 7, 8]),  # its prefix was generated
        seq(SamplingParams(temperature=0, bad_words_token_ids=words), output=[7, 9]),  # not its prefix: allowed
    ]
    assert sample(logits, seqs).token_ids == [second[0], second[1], best[2]]
