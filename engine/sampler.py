"""Turns one step's logits into next tokens: one row per sequence, vectorised over the batch.

Order of work on each row (vLLM's and HF's order, so behaviour matches what users expect):
  1. penalties on the model's logits: repetition (CTRL/HF, prompt + output tokens), then
     frequency and presence (OpenAI, output tokens only);
  2. logit_bias is added; stop tokens are masked to -inf while fewer than min_tokens were generated;
  3. greedy rows (temperature 0) take the argmax;
  4. sampled rows divide by temperature, drop tokens under min_p * max_prob, keep the top_k best,
     then the smallest best-first set whose mass (renormalised over what is left) reaches top_p,
     and draw one token by inverse CDF from a single uniform number per row.

Why inverse CDF rather than an exponential race: one uniform per row makes a seeded row's draw a
pure function of (seed, number of tokens generated so far, the row's own logits), so the same seed
gives the same tokens whatever else is in the batch and after preemption (recompute), and it costs
one exp + one cumsum over the row instead of a random number per vocabulary entry (the race cost
about 85-130 ms per step at batch 32, vocab 128256 on this CPU). The cumulative sum runs in
float64 so the tail of a 128k vocabulary is not rounded away.

Logprobs follow vLLM's and OpenAI's convention: values of log_softmax of the raw model logits,
before penalties, bias, temperature and truncation; top alternatives are the k most likely raw
tokens, best first.

Ties: truncation keeps every token whose value equals the threshold, so exact ties at the top_k
or top_p boundary can keep a few extra tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from engine.sequence import Sequence
from engine.types import SamplingParams, TokenLogprob

_MIN_TEMPERATURE = 1e-5  # below this a row is greedy: dividing by it would overflow float32
# top_p without top_k first looks at this many best tokens and sorts the whole row only when
# they hold less than top_p of the mass (a full sort of 128k entries costs ~6 ms a row on CPU).
_TOP_P_PREFIX_TOKENS = 1024
_MASK_64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # [num_seqs]; -1 where the row failed
    logprobs: list[TokenLogprob | None]  # [num_seqs]; None where not asked for or failed
    errors: dict[int, str]  # seq_id -> why this row alone failed


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed mod 2**64, step)."""
    z = _splitmix64((_splitmix64(seed & _MASK_64) + step) & _MASK_64)
    return (z >> 11) * (1.0 / (1 << 53))


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


class Sampler:
    """Stateless across steps except for the generator of unseeded rows."""

    def __init__(self, *, stop_token_ids: frozenset[int] = frozenset(), seed: int = 0) -> None:
        self._stop_token_ids = stop_token_ids  # the family's EOS/EOT/EOM ids, masked under min_tokens
        self._rng = random.Random(seed)  # unseeded rows share it

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [num_seqs, vocab] float32, row i belongs to seqs[i]."""
        num_seqs = len(seqs)
        if num_seqs == 0:
            return SampleResult([], [], {})
        if logits.dtype != torch.float32:
            logits = logits.float()
        if all(self._is_plain_greedy(seq) for seq in seqs):
            return _argmax_only(logits, seqs)
        return self._sample_general(logits, seqs)

    # ------------------------------------------------------------------ general path
    def _sample_general(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        vocab = logits.shape[1]
        device = logits.device
        errors: dict[int, str] = {}
        failed = [False] * len(seqs)
        raw_max = logits.amax(dim=1).tolist()  # NaN or +inf anywhere in the row shows here
        for row, value in enumerate(raw_max):
            if not math.isfinite(value):
                failed[row] = True
                errors[seqs[row].seq_id] = f"the model produced non-finite logits (row max {value})"
        for row, seq in enumerate(seqs):
            bad = [t for t, _ in seq.params.logit_bias if not 0 <= t < vocab]
            if bad and not failed[row]:
                failed[row] = True
                errors[seq.seq_id] = f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})"

        x = logits.clone()
        failed_rows = [row for row, f in enumerate(failed) if f]
        if failed_rows:  # keep failed rows finite so they cannot poison shared arithmetic
            x[torch.tensor(failed_rows, device=device)] = 0.0
        live = [row for row, f in enumerate(failed) if not f]
        _apply_penalties(x, [(row, seqs[row]) for row in live if _has_penalties(seqs[row].params)])
        _apply_logit_bias(x, [(row, seqs[row].params) for row in live if seqs[row].params.logit_bias])
        self._mask_stop_tokens(x, [(row, seqs[row]) for row in live])

        tokens = [-1] * len(seqs)
        greedy = [row for row in live if _is_greedy(seqs[row].params)]
        sampled = [row for row in live if not _is_greedy(seqs[row].params)]
        for rows, chosen, row_max in (
            _pick_greedy(x, greedy),
            self._pick_sampled(x, [(row, seqs[row]) for row in sampled]),
        ):
            for row, token, value in zip(rows, chosen, row_max):
                if not math.isfinite(value):  # bias and min_tokens masked every token, or a bias was inf
                    errors[seqs[row].seq_id] = "no token is left to sample: logit_bias or min_tokens masked every token"
                else:
                    tokens[row] = token
        want = [row for row in range(len(seqs)) if tokens[row] >= 0 and seqs[row].params.logprobs is not None]
        logprobs = _logprobs(logits, seqs, tokens, want)
        return SampleResult(tokens, logprobs, errors)

    def _is_plain_greedy(self, seq: Sequence) -> bool:
        p = seq.params
        return (
            _is_greedy(p)
            and not _has_penalties(p)
            and not p.logit_bias
            and p.logprobs is None
            and not self._stops_masked(seq)
        )

    def _stops_masked(self, seq: Sequence) -> bool:
        return seq.num_output_tokens < seq.params.min_tokens

    def _mask_stop_tokens(self, x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
        vocab = x.shape[1]
        index_rows: list[int] = []
        index_tokens: list[int] = []
        for row, seq in rows:
            if not self._stops_masked(seq):
                continue
            # with ignore_eos the family's stop tokens do not stop, so there is nothing to hold back
            stops = set(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                stops |= self._stop_token_ids
            valid = [t for t in stops if 0 <= t < vocab]
            index_rows += [row] * len(valid)
            index_tokens += valid
        if index_rows:
            idx = (torch.tensor(index_rows, device=x.device), torch.tensor(index_tokens, device=x.device))
            x.index_put_(idx, torch.tensor(-math.inf, device=x.device))

    def _pick_sampled(self, x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> tuple[list[int], list[int], list[float]]:
        if not rows:
            return [], [], []
        device = x.device
        vocab = x.shape[1]
        row_ids = [row for row, _ in rows]
        params = [seq.params for _, seq in rows]
        xs = x[torch.tensor(row_ids, device=device)]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        xs.div_(temperature.unsqueeze(1))
        row_max = xs.amax(dim=1, keepdim=True)
        row_max_list = row_max.squeeze(1).tolist()
        dead = [i for i, value in enumerate(row_max_list) if not math.isfinite(value)]
        if dead:  # the caller reports these rows; keep the arithmetic finite meanwhile
            dead_idx = torch.tensor(dead, device=device)
            xs[dead_idx] = 0.0
            row_max[dead_idx] = 0.0
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p_rows:
            _apply_min_p(xs, row_max, min_p_rows, [params[i].min_p for i in min_p_rows])
        uniforms = [
            seeded_uniform(p.seed, seq.num_output_tokens) if p.seed is not None else self._rng.random()
            for (_, seq), p in zip(rows, params)
        ]
        truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
        full = [i for i, p in enumerate(params) if not (0 < p.top_k < vocab or p.top_p < 1)]
        chosen = [0] * len(rows)
        for group, picker in ((full, _sample_full), (truncated, _sample_truncated)):
            if not group:
                continue
            g = torch.tensor(group, device=device)
            u = torch.tensor([uniforms[i] for i in group], dtype=torch.float64, device=device)
            if picker is _sample_full:
                picked = _sample_full(xs[g], row_max[g], u)
            else:
                top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in group]
                top_p = [params[i].top_p for i in group]
                picked = _sample_truncated(xs[g], row_max[g], top_k, top_p, u, _TOP_P_PREFIX_TOKENS)
            for i, token in zip(group, picked.tolist()):
                chosen[i] = token
        return row_ids, chosen, row_max_list


# ---------------------------------------------------------------------- pieces (pure functions)
def _argmax_only(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """The all-greedy, nothing-else fast path: one pass over the logits."""
    values, ids = logits.max(dim=1)
    tokens = ids.tolist()
    errors: dict[int, str] = {}
    for row, value in enumerate(values.tolist()):
        if not math.isfinite(value):  # NaN or +inf anywhere, or a row of -inf
            errors[seqs[row].seq_id] = f"the model produced non-finite logits (row max {value})"
            tokens[row] = -1
    return SampleResult(tokens, [None] * len(seqs), errors)


def _apply_penalties(x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """Repetition (HF/CTRL: seen tokens' logits divided by the penalty if positive, multiplied if
    negative, seen = prompt + output), then OpenAI's `logit -= count * frequency + (count > 0) *
    presence` over output tokens."""
    if not rows:
        return
    device = x.device
    vocab = x.shape[1]
    rep = [(row, seq) for row, seq in rows if seq.params.repetition_penalty != 1]
    if rep:
        idx = torch.tensor([row for row, _ in rep], device=device)
        seen = _token_counts([seq.token_ids for _, seq in rep], vocab, device) > 0
        penalty = torch.tensor([seq.params.repetition_penalty for _, seq in rep], device=device).unsqueeze(1)
        sub = x[idx]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        x[idx] = torch.where(seen, penalised, sub)
    additive = [(row, seq) for row, seq in rows if seq.params.presence_penalty != 0 or seq.params.frequency_penalty != 0]
    if additive:
        idx = torch.tensor([row for row, _ in additive], device=device)
        counts = _token_counts([seq.output_token_ids for _, seq in additive], vocab, device)
        frequency = torch.tensor([seq.params.frequency_penalty for _, seq in additive], device=device).unsqueeze(1)
        presence = torch.tensor([seq.params.presence_penalty for _, seq in additive], device=device).unsqueeze(1)
        x[idx] -= counts * frequency + (counts > 0).float() * presence


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    ok = (flat >= 0) & (flat < vocab)  # ids the model cannot emit carry no penalty
    counts.index_put_((rows[ok], flat[ok]), torch.ones((), device=device), accumulate=True)
    return counts


def _apply_logit_bias(x: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    if not rows:
        return
    index_rows = [row for row, p in rows for _ in p.logit_bias]
    index_tokens = [t for _, p in rows for t, _ in p.logit_bias]
    bias = [b for _, p in rows for _, b in p.logit_bias]
    device = x.device
    idx = (torch.tensor(index_rows, device=device), torch.tensor(index_tokens, device=device))
    x.index_put_(idx, torch.tensor(bias, dtype=x.dtype, device=device), accumulate=True)


def _pick_greedy(x: torch.Tensor, rows: list[int]) -> tuple[list[int], list[int], list[float]]:
    if not rows:
        return [], [], []
    values, ids = x[torch.tensor(rows, device=x.device)].max(dim=1)
    return rows, ids.tolist(), values.tolist()


def _apply_min_p(xs: torch.Tensor, row_max: torch.Tensor, rows: list[int], min_p: list[float]) -> None:
    """prob < min_p * max_prob  <=>  logit < max_logit + log(min_p): no softmax needed."""
    idx = torch.tensor(rows, device=xs.device)
    floor = row_max[idx] + torch.tensor([math.log(p) for p in min_p], device=xs.device).unsqueeze(1)
    sub = xs[idx]
    xs[idx] = sub.masked_fill(sub < floor, -math.inf)


def _draw(cumulative: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds u * total; total > 0 and u in [0, 1)."""
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target.unsqueeze(1), right=True).squeeze(1)


def _sample_full(xs: torch.Tensor, row_max: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the whole row in vocabulary order."""
    cumulative = torch.cumsum(torch.exp(xs - row_max), dim=1, dtype=torch.float64)
    return _draw(cumulative, cumulative[:, -1], u)


def _sample_truncated(
    xs: torch.Tensor, row_max: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor, prefix: int
) -> torch.Tensor:
    """top_k then top_p, then inverse CDF over the kept tokens in best-first order.

    Works on the `k` best tokens of each row, k = max(top_k, prefix when a row has only top_p);
    rows whose top_p mass is not inside that prefix are redone over the fully sorted row."""
    vocab = xs.shape[1]
    device = xs.device
    has_k = [k < vocab for k in top_k]
    k = min(vocab, max([kk for kk, h in zip(top_k, has_k) if h] + [prefix if not all(has_k) else 0]))
    values, ids = torch.topk(xs, k, dim=1)  # best first
    weights = torch.exp(values - row_max)
    top_k_t = torch.tensor(top_k, device=device)
    weights.masked_fill_(torch.arange(k, device=device) >= top_k_t.unsqueeze(1), 0.0)
    cumulative = torch.cumsum(weights, dim=1, dtype=torch.float64)
    # top_p is relative to the mass left after top_k; without top_k that is the whole row's
    mass = cumulative[:, -1].clone()
    no_k = [i for i, h in enumerate(has_k) if not h]
    if no_k:
        no_k_t = torch.tensor(no_k, device=device)
        mass[no_k_t] = torch.exp(xs[no_k_t] - row_max[no_k_t]).sum(dim=1, dtype=torch.float64)
    top_p_t = torch.tensor(top_p, dtype=torch.float64, device=device)
    before = cumulative - weights.double()  # mass strictly better than each token
    keep = (before < (top_p_t * mass).unsqueeze(1)) & (weights > 0)  # a best-first prefix of each row
    num_kept = keep.sum(dim=1)
    kept_mass = cumulative.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    picked = ids.gather(1, _draw(cumulative, kept_mass, u).unsqueeze(1)).squeeze(1)
    if k < vocab:
        short = (num_kept == k) & (cumulative[:, -1] < top_p_t * mass)
        short_rows = [i for i, s in enumerate(short.tolist()) if s and not has_k[i]]
        if short_rows:
            idx = torch.tensor(short_rows, device=device)
            picked[idx] = _sample_truncated(
                xs[idx], row_max[idx], [top_k[i] for i in short_rows], [top_p[i] for i in short_rows], u[idx], vocab
            )
    return picked


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], rows: list[int]
) -> list[TokenLogprob | None]:
    """Raw-model log-softmax of the sampled token and the k best alternatives, k = params.logprobs."""
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    device = logits.device
    idx = torch.tensor(rows, device=device)
    logprobs = torch.log_softmax(logits[idx], dim=1)
    chosen_ids = torch.tensor([tokens[row] for row in rows], device=device)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    ks = [min(seqs[row].params.logprobs or 0, logits.shape[1]) for row in rows]
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max(ks) > 0:
        values, ids = torch.topk(logprobs, max(ks), dim=1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for i, row in enumerate(rows):
        top = list(zip(top_ids[i][: ks[i]], top_values[i][: ks[i]]))
        out[row] = TokenLogprob(token_id=tokens[row], logprob=chosen[i], top=top)
    return out
