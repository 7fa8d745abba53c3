"""Turns one step's logits into next tokens: one row per sequence, vectorised over the batch.

Order of work on each row (vLLM's and HF's order, so behaviour matches what users expect):
  1. penalties on the model's logits: repetition (CTRL/HF, prompt + output tokens), then
     frequency and presence (OpenAI, output tokens only);
  2. logit_bias is added; stop tokens are masked to -inf while fewer than min_tokens were generated;
     tokens outside allowed_token_ids and bad words' next tokens are masked;
     constrained rows (params.grammar) mask every token their grammar does not allow next;
  3. greedy rows (temperature 0) take the argmax;
  4. sampled rows divide by temperature, drop tokens under min_p * max_prob, keep the top_k best,
     then the smallest best-first set whose mass (renormalised over what is left) reaches top_p,
     and draw a token by inverse CDF from uniform numbers.

Randomness: each row draws from its own 64-bit splitmix stream, started from (seed, number of
tokens generated so far) for seeded requests and from the sampler's generator otherwise. So a
seeded draw is a pure function of the seed, the step and the row's own logits: the same whatever
else is in the batch, and the same after preemption (recompute). Inverse CDF needs one uniform
per row instead of the exponential race's one per vocabulary entry (that noise alone cost tens
of milliseconds per step at batch 32 over a 128k vocabulary: bench/NOTES.md). Cumulative sums run in float64 so the tail of a
128k vocabulary is not rounded away.

top_p without top_k never sorts the vocabulary (a full sort is slow on CPU, bench/NOTES.md):
it draws from the row, accepts the token if the mass strictly better than it is < top_p, and
otherwise redraws among strictly better tokens. Each round accepts with probability >= top_p and
the accepted token is distributed exactly as the renormalised top_p set.

Logprobs follow vLLM's and OpenAI's convention: log_softmax of the raw model logits, before
penalties, bias, temperature and truncation; the top alternatives are the k most likely raw
tokens, best first.

Ties: truncation keeps every token whose value equals the cut, so exact ties at the top_k or
top_p boundary can keep a few extra tokens.

Two paths, chosen by the logits' device alone (issue 33). Logits on the CPU take the host path
(the fused kernels' argmax for plain greedy batches, sparse penalties, numpy where it is faster).
Logits anywhere else take the device path (`Sampler.sample_on_device`, which also runs on CPU
tensors, as the tests and bench/sampler.py run it): the same steps with every vocabulary-sized
tensor left on the logits' device. The host sends small tensors (per-row parameters, the rows'
uniforms computed from the same splitmix64 streams, token ids for penalties and masks, grammar
bitmasks packed 32 tokens to a word) and reads back one packed tensor: the chosen ids, row maxima
for the error checks and the requested logprobs. Rows with top_p and no top_k also read, each
rejection round, which of them are still drawing (expected < 1/top_p rounds, as on the host).
Both paths give the same tokens and logprobs (tests/engine/test_sampler_device.py).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.cpu import CpuKernels, supports
from engine.core.sequence import Sequence
from engine.core.structured import GrammarState
from engine.types import SamplingParams, TokenLogprob

_MIN_TEMPERATURE = 1e-5  # below this a row is greedy: dividing by it would overflow float32
_MAX_TOP_P_ROUNDS = 16  # rejection rounds before a row falls back to a sort (expected < 1/top_p)
_CHUNK = 1024  # tokens per chunk of the two-stage inverse CDF
_MASK_64 = (1 << 64) - 1
_Picks = tuple[list[int], list[int], list[float]]  # (rows, chosen token per row, row max after processing)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # [num_seqs]; -1 where the row failed
    logprobs: list[TokenLogprob | None]  # [num_seqs]; None where not asked for or failed
    errors: dict[int, str]  # seq_id -> why this row alone failed


# ---------------------------------------------------------------------- per-row random streams
def seeded_state(seed: int, step: int) -> int:
    """The start of a seeded row's random stream: depends only on (seed mod 2**64, step)."""
    return _splitmix64((_splitmix64(seed & _MASK_64) + step) & _MASK_64)


def next_uniform(state: int) -> tuple[float, int]:
    """(u in [0, 1), next state)."""
    state = _splitmix64(state)
    return (state >> 11) * (1.0 / (1 << 53)), state


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


class UniformStreams:
    """Many rows' random streams advanced together in numpy: each call of next() gives every row
    its next_uniform, the same numbers bit for bit (numpy's uint64 arithmetic wraps as
    _splitmix64 masks), as a float64 tensor on `device`."""

    __slots__ = ("_state", "_device")

    def __init__(self, states: list[int], device: torch.device) -> None:
        self._state = np.array(states, dtype=np.uint64).reshape(len(states))
        self._device = device

    def next(self) -> torch.Tensor:
        z = self._state + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        self._state = z ^ (z >> np.uint64(31))
        u = (self._state >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        return torch.from_numpy(u).to(self._device)


def is_greedy(params: SamplingParams) -> bool:
    """Whether rows with these params take the argmax (the verifier of speculative decoding asks too)."""
    return params.temperature < _MIN_TEMPERATURE


def _has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


class Sampler:
    """Stateless across steps except for the generator of unseeded rows."""

    def __init__(self, *, seed: int = 0, kernels: CpuKernels | None = None) -> None:
        self._rng = random.Random(seed)  # unseeded rows share it
        self._kernels = kernels  # the fused CPU kernels' greedy argmax; None: numpy's

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [num_seqs, vocab] (float32, or the model dtype: widened to float32 here), row i
        belongs to seqs[i]. Never modifies logits."""
        _check_shape(logits, seqs)
        if not seqs:
            return SampleResult([], [], {})
        if not logits.is_cpu:
            return self.sample_on_device(logits, seqs)
        if all(self._is_plain_greedy(seq) for seq in seqs):
            return _argmax_only(logits, seqs, self._kernels)
        if logits.dtype != torch.float32:
            logits = logits.float()
        return self._sample_general(logits, seqs)

    def _is_plain_greedy(self, seq: Sequence) -> bool:
        p = seq.params
        return is_greedy(p) and p.logprobs is None and not self._modifies_logits(seq)

    def _modifies_logits(self, seq: Sequence) -> bool:
        return (
            _has_penalties(seq.params) or bool(seq.params.logit_bias) or self._stops_masked(seq) or seq.grammar is not None
            or _masks_tokens(seq.params)
        )

    def _stops_masked(self, seq: Sequence) -> bool:
        return seq.num_output_tokens < seq.params.min_tokens

    # ------------------------------------------------------------------ general path
    def _sample_general(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        errors = _row_errors(logits, seqs)
        live = [row for row, seq in enumerate(seqs) if seq.seq_id not in errors]
        x = logits
        if errors or any(self._modifies_logits(seq) for seq in seqs):
            x = logits.clone(memory_format=torch.contiguous_format)  # the caller's stay raw for logprobs
            if errors:  # keep failed rows finite so they cannot poison shared arithmetic
                failed = [row for row, seq in enumerate(seqs) if seq.seq_id in errors]
                x[torch.tensor(failed, device=x.device)] = 0.0
            _apply_penalties(x, [(row, seqs[row]) for row in live if _has_penalties(seqs[row].params)])
            _apply_logit_bias(x, [(row, seqs[row].params) for row in live if seqs[row].params.logit_bias])
            self._mask_stop_tokens(x, [(row, seqs[row]) for row in live if self._stops_masked(seqs[row])])
            _apply_token_masks(x, [(row, seqs[row]) for row in live if _masks_tokens(seqs[row].params)])
            constrained = [row for row in live if seqs[row].grammar is not None]
            _apply_grammar_masks(x, constrained, [seqs[row].grammar for row in constrained])

        tokens = [-1] * len(seqs)
        greedy = [row for row in live if is_greedy(seqs[row].params)]
        sampled = [row for row in live if not is_greedy(seqs[row].params)]
        for rows, chosen, row_max in (_pick_greedy(x, greedy), self._pick_sampled(x, sampled, seqs)):
            for row, token, value in zip(rows, chosen, row_max):
                if math.isfinite(value):
                    tokens[row] = token
                else:  # bias, min_tokens or the grammar masked every token, or a bias was infinite
                    errors[seqs[row].seq_id] = _NOTHING_LEFT
        want = [row for row in range(len(seqs)) if tokens[row] >= 0 and seqs[row].params.logprobs is not None]
        return SampleResult(tokens, _logprobs(logits, seqs, tokens, want), errors)

    def _mask_stop_tokens(self, x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
        vocab = x.shape[1]
        index_rows: list[int] = []
        index_tokens: list[int] = []
        for row, seq in rows:
            valid = [t for t in seq.stop_token_ids if 0 <= t < vocab]  # Scheduler.add set them
            index_rows += [row] * len(valid)
            index_tokens += valid
        if index_rows:
            idx = (torch.tensor(index_rows, device=x.device), torch.tensor(index_tokens, device=x.device))
            x.index_put_(idx, torch.tensor(-math.inf, device=x.device))

    def _pick_sampled(self, x: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> _Picks:
        if not rows:
            return [], [], []
        vocab = x.shape[1]
        params = [seqs[row].params for row in rows]
        weights, row_max = _weights(_take(x, rows), [p.temperature for p in params], [p.min_p for p in params])
        states = [
            seeded_state(p.seed, seqs[row].num_output_tokens) if p.seed is not None else self._rng.getrandbits(64)
            for row, p in zip(rows, params)
        ]
        has_k = [0 < p.top_k < vocab for p in params]
        groups = (
            ([i for i, p in enumerate(params) if not has_k[i] and p.top_p >= 1], _sample_full),
            ([i for i, p in enumerate(params) if has_k[i]], _sample_top_k),
            ([i for i, p in enumerate(params) if not has_k[i] and p.top_p < 1], _sample_top_p),
        )
        chosen = [0] * len(rows)
        for group, picker in groups:
            if group:
                top_k = [params[i].top_k for i in group]
                top_p = [params[i].top_p for i in group]
                picked = picker(_take(weights, group), top_k, top_p, [states[i] for i in group])
                for i, token in zip(group, picked.tolist()):
                    chosen[i] = token
        return rows, chosen, row_max

    # ------------------------------------------------------------------ device path
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """sample()'s result with every vocabulary-sized tensor left on the logits' device: what
        sample() runs for logits off the CPU, callable on CPU tensors too. One device-to-host copy
        (a packed float64 tensor), plus a bool per row still drawing per top_p rejection round;
        never modifies logits."""
        _check_shape(logits, seqs)
        if not seqs:
            return SampleResult([], [], {})
        if all(self._is_plain_greedy(seq) for seq in seqs):  # the argmax alone; bfloat16 needs no copy
            values, ids = logits.max(dim=1)
            return _unpack(torch.cat([ids.double(), values.double(), values.double()]).tolist(), seqs, {}, [], 0)
        raw = logits if logits.dtype == torch.float32 else logits.float()
        vocab = raw.shape[1]
        bad_bias = _bias_errors(seqs, vocab)
        live = [row for row, seq in enumerate(seqs) if seq.seq_id not in bad_bias]
        x = raw
        if any(self._modifies_logits(seqs[row]) for row in live):
            x = raw.clone(memory_format=torch.contiguous_format)  # raw stays for logprobs
            _apply_penalties_dense(x, [(row, seqs[row]) for row in live if _has_penalties(seqs[row].params)])
            _apply_logit_bias(x, [(row, seqs[row].params) for row in live if seqs[row].params.logit_bias])
            self._mask_stop_tokens(x, [(row, seqs[row]) for row in live if self._stops_masked(seqs[row])])
            _apply_token_masks(x, [(row, seqs[row]) for row in live if _masks_tokens(seqs[row].params)])
            constrained = [row for row in live if seqs[row].grammar is not None]
            _apply_grammar_masks(x, constrained, [seqs[row].grammar for row in constrained], unpack_on_device=True)

        device = x.device
        tokens = torch.full((len(seqs),), -1, dtype=torch.int64, device=device)
        best = torch.full((len(seqs),), math.nan, device=device)  # row max after processing; not finite: no token left
        greedy = [row for row in live if is_greedy(seqs[row].params)]
        if greedy:
            values, ids = _take(x, greedy).max(dim=1)  # the first best id, as _row_max
            index = torch.tensor(greedy, device=device)
            tokens[index], best[index] = ids, values
        sampled = [row for row in live if not is_greedy(seqs[row].params)]
        if sampled:
            ids, row_max = self._draw_on_device(x, sampled, seqs)
            index = torch.tensor(sampled, device=device)
            tokens[index], best[index] = ids, row_max

        pieces = [tokens.double(), raw.amax(dim=1).double(), best.double()]
        want = [row for row in live if seqs[row].params.logprobs is not None]
        k = min(max((seqs[row].params.logprobs or 0 for row in want), default=0), vocab)
        if want:  # failed rows' logprobs are computed too (the host learns of failures last) and dropped
            chosen_ids = tokens[torch.tensor(want, device=device)].clamp(min=0)
            chosen, top_values, top_ids = _logprob_tensors(raw, want, chosen_ids, k)
            pieces += [chosen.double(), top_ids.double().flatten(), top_values.double().flatten()]
        return _unpack(torch.cat(pieces).tolist(), seqs, bad_bias, want, k)  # the one device-to-host copy

    def _draw_on_device(self, x: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """_pick_sampled on the device: (token per row, row max after processing), both [len(rows)]
        tensors. The rows' uniforms are those _pick_sampled draws, from the same streams, computed on
        the host for all rows of a group at once and sent as one tensor per draw."""
        device, vocab = x.device, x.shape[1]
        params = [seqs[row].params for row in rows]
        table = torch.tensor([[p.temperature, p.min_p, p.top_p] for p in params], dtype=torch.float64, device=device)
        min_p = table[:, 1].float() if any(p.min_p > 0 for p in params) else None
        weights, row_max = _weights_tensor(_take(x, rows), table[:, 0].float(), min_p)
        weights.masked_fill_(~torch.isfinite(row_max), 1.0)  # as _weights: the caller reports these rows
        states = [  # drawn in _pick_sampled's order, so unseeded rows get the same streams
            seeded_state(p.seed, seqs[row].num_output_tokens) if p.seed is not None else self._rng.getrandbits(64)
            for row, p in zip(rows, params)
        ]
        has_k = [0 < p.top_k < vocab for p in params]
        picked = torch.empty(len(rows), dtype=torch.int64, device=device)
        full = [i for i, p in enumerate(params) if not has_k[i] and p.top_p >= 1]
        if full:
            index = torch.tensor(full, device=device)
            u = UniformStreams([states[i] for i in full], device).next()
            picked[index] = _draw_from_weights(_take(weights, full), u)
        top_k = [i for i in range(len(rows)) if has_k[i]]
        if top_k:
            index = torch.tensor(top_k, device=device)
            u = UniformStreams([states[i] for i in top_k], device).next()
            picked[index] = _top_k_draw(_take(weights, top_k), [params[i].top_k for i in top_k], table[index, 2], u)
        rejection = [i for i, p in enumerate(params) if not has_k[i] and p.top_p < 1]
        if rejection:
            index = torch.tensor(rejection, device=device)
            streams = UniformStreams([states[i] for i in rejection], device)
            picked[index] = _top_p_draw(_take(weights, rejection), table[index, 2], streams)
        return picked, row_max.squeeze(1)


# ---------------------------------------------------------------------- pieces (pure functions)
def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without a copy when rows is every row in order (the common case)."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _row_max(x: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's first best id and its value (NaN anywhere wins, as in torch.max). On CPU through
    numpy: torch's max(dim=1) over a [32, 49152] float32 batch costs 1.5 ms on one thread and
    several on two threads of a busy machine, numpy's argmax plus a gather a quarter of a ms."""
    if not x.is_cpu or x.dtype != torch.float32:
        values, ids = x.max(dim=1)
        return ids.tolist(), values.tolist()
    array = x.numpy()
    ids = array.argmax(axis=1).tolist()
    return ids, [float(row[i]) for row, i in zip(array, ids)]  # a few rows: cheaper than a fancy-index gather


def _greedy_row_max(logits: torch.Tensor, kernels: CpuKernels | None) -> tuple[list[int], list[float]]:
    """_row_max(logits.float()). float32 and bfloat16 logits on CPU go through the fused kernels'
    argmax: the same ids and values, bfloat16 without the float32 copy of the batch (at [32, 49152]
    the copy cost more than numpy's argmax) and float32 on every thread (numpy's takes one):
    bench/NOTES.md. Without the kernels, numpy."""
    kernel_rows = logits.is_cpu and supports(logits.dtype) and logits.stride(1) == 1 and logits.shape[1] > 0
    if kernels is None or not kernel_rows:
        return _row_max(logits.float())
    return kernels.argmax_rows(logits, torch.get_num_threads())


def _argmax_only(logits: torch.Tensor, seqs: list[Sequence], kernels: CpuKernels | None) -> SampleResult:
    """The all-greedy, nothing-else fast path: one pass over the logits."""
    tokens, values = _greedy_row_max(logits, kernels)
    errors: dict[int, str] = {}
    for row, value in enumerate(values):
        if not math.isfinite(value):  # NaN or +inf anywhere, or a row of -inf
            errors[seqs[row].seq_id] = _non_finite(value)
            tokens[row] = -1
    return SampleResult(tokens, [None] * len(seqs), errors)


def _check_shape(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(seqs):  # an executor bug: fail the batch
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(seqs)} sequences")


def _non_finite(value: float) -> str:
    return f"the model produced non-finite logits (row max {value})"


_NOTHING_LEFT = "no token left to sample: logit_bias, min_tokens, allowed_token_ids, bad_words or the grammar masked them all"


def _row_errors(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
    """Rows that cannot be sampled at all: non-finite model output or a bias id out of range."""
    bad_bias = _bias_errors(seqs, logits.shape[1])
    errors: dict[int, str] = {}
    for seq, value in zip(seqs, logits.amax(dim=1).tolist()):  # NaN or +inf anywhere shows in the max
        if not math.isfinite(value):
            errors[seq.seq_id] = _non_finite(value)
        elif seq.seq_id in bad_bias:
            errors[seq.seq_id] = bad_bias[seq.seq_id]
    return errors


def _bias_errors(seqs: list[Sequence], vocab: int) -> dict[int, str]:
    """seq_id -> why, for rows whose logit_bias names a token outside the vocabulary."""
    errors: dict[int, str] = {}
    for seq in seqs:
        bad = [t for t, _ in seq.params.logit_bias if not 0 <= t < vocab]
        if bad:
            errors[seq.seq_id] = f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})"
    return errors


def _unpack(flat: list[float], seqs: list[Sequence], bad_bias: dict[int, str], want: list[int], k: int) -> SampleResult:
    """The device path's one copy back, read: [tokens, raw row max, row max after processing] per
    row, then for the `want` rows the chosen logprob, k top ids and k top logprobs (row-major).
    Errors in _row_errors' order: non-finite logits, then a bad bias, then nothing left."""
    n = len(seqs)
    tokens = [int(t) for t in flat[:n]]
    errors: dict[int, str] = {}
    for row, seq in enumerate(seqs):
        raw_max, best = flat[n + row], flat[2 * n + row]
        if not math.isfinite(raw_max):
            errors[seq.seq_id] = _non_finite(raw_max)
        elif seq.seq_id in bad_bias:
            errors[seq.seq_id] = bad_bias[seq.seq_id]
        elif not math.isfinite(best):  # bias, min_tokens or the grammar masked every token, or a bias was infinite
            errors[seq.seq_id] = _NOTHING_LEFT
        if seq.seq_id in errors:
            tokens[row] = -1
    logprobs: list[TokenLogprob | None] = [None] * n
    start = 3 * n
    top_ids, top_values = start + len(want), start + len(want) * (1 + k)
    for i, row in enumerate(want):
        if tokens[row] >= 0:
            ids = flat[top_ids + i * k : top_ids + (i + 1) * k]
            values = flat[top_values + i * k : top_values + (i + 1) * k]
            count = min(seqs[row].params.logprobs or 0, k)
            top = [(int(t), v) for t, v in zip(ids[:count], values[:count])]
            logprobs[row] = TokenLogprob(token_id=tokens[row], logprob=flat[start + i], top=top)
    return SampleResult(tokens, logprobs, errors)


def _apply_penalties(x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """Repetition (HF/CTRL: a seen token's logit is divided by the penalty if positive, multiplied
    if not; seen = prompt + output), then OpenAI's `logit -= count * frequency + (count > 0) *
    presence` over output tokens. x is contiguous; cost is O(tokens), not O(vocab)."""
    flat = x.view(-1)
    rep = [(row, seq) for row, seq in rows if seq.params.repetition_penalty != 1]
    if rep:
        keys, _, key_rows = _token_keys([(row, seq.token_ids) for row, seq in rep], x.shape[1], x.device)
        penalty = _per_row(x, [(row, seq.params.repetition_penalty) for row, seq in rep])[key_rows]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    additive = [(row, seq) for row, seq in rows if seq.params.presence_penalty or seq.params.frequency_penalty]
    if additive:
        outputs = [(row, seq.output_token_ids) for row, seq in additive]
        keys, counts, key_rows = _token_keys(outputs, x.shape[1], x.device)
        frequency = _per_row(x, [(row, seq.params.frequency_penalty) for row, seq in additive])[key_rows]
        presence = _per_row(x, [(row, seq.params.presence_penalty) for row, seq in additive])[key_rows]
        flat[keys] -= counts * frequency + presence


def _token_keys(
    rows: list[tuple[int, list[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs as flat indices row * vocab + token, their counts, their rows."""
    lengths = torch.tensor([len(tokens) for _, tokens in rows], device=device)
    tokens = torch.tensor(list(itertools.chain.from_iterable(t for _, t in rows)), dtype=torch.int64, device=device)
    row_of = torch.repeat_interleave(torch.tensor([row for row, _ in rows], device=device), lengths)
    ok = (tokens >= 0) & (tokens < vocab)  # ids the model cannot emit carry no penalty
    keys, counts = torch.unique(row_of[ok] * vocab + tokens[ok], return_counts=True)
    return keys, counts.to(torch.float32), keys // vocab


def _per_row(x: torch.Tensor, values: list[tuple[int, float]]) -> torch.Tensor:
    """[num_rows of x] float32 holding each listed row's value (0 elsewhere)."""
    out = torch.zeros(x.shape[0], device=x.device)
    rows = torch.tensor([row for row, _ in values], device=x.device)
    out[rows] = torch.tensor([v for _, v in values], device=x.device)
    return out


def _apply_penalties_dense(x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """_apply_penalties' arithmetic, element for element, over dense [rows, vocab] token counts:
    the sparse form's torch.unique makes the host wait for the device to learn how many keys."""
    rep = [(row, seq) for row, seq in rows if seq.params.repetition_penalty != 1]
    if rep:
        index = torch.tensor([row for row, _ in rep], device=x.device)
        seen = _dense_counts([seq.token_ids for _, seq in rep], x.shape[1], x.device) > 0
        penalty = torch.tensor([seq.params.repetition_penalty for _, seq in rep], device=x.device).unsqueeze(1)
        sub = x.index_select(0, index)
        x.index_copy_(0, index, torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub))
    additive = [(row, seq) for row, seq in rows if seq.params.presence_penalty or seq.params.frequency_penalty]
    if additive:
        index = torch.tensor([row for row, _ in additive], device=x.device)
        counts = _dense_counts([seq.output_token_ids for _, seq in additive], x.shape[1], x.device)
        frequency = torch.tensor([seq.params.frequency_penalty for _, seq in additive], device=x.device).unsqueeze(1)
        presence = torch.tensor([seq.params.presence_penalty for _, seq in additive], device=x.device).unsqueeze(1)
        sub = x.index_select(0, index)
        x.index_copy_(0, index, torch.where(counts > 0, sub - (counts * frequency + presence), sub))


def _dense_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each row's list holds each token (ids the
    model cannot emit are not counted). The lists go over padded into one int64 tensor."""
    ids = np.full((len(token_lists), max(map(len, token_lists), default=0) or 1), vocab, dtype=np.int64)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = tokens
    index = torch.from_numpy(ids).to(device)
    index = torch.where((index >= 0) & (index < vocab), index, vocab)  # vocab: the padding column
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab]


def _apply_logit_bias(x: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    if not rows:
        return
    device = x.device
    index_rows = torch.tensor([row for row, p in rows for _ in p.logit_bias], device=device)
    index_tokens = torch.tensor([t for _, p in rows for t, _ in p.logit_bias], device=device)
    bias = torch.tensor([b for _, p in rows for _, b in p.logit_bias], dtype=x.dtype, device=device)
    x.index_put_((index_rows, index_tokens), bias, accumulate=True)


def _masks_tokens(params: SamplingParams) -> bool:
    return params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def _apply_token_masks(x: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """allowed_token_ids and bad words: -inf, in x, for every token a row may not take next. The
    host lists (row, token) pairs; the masks are built and applied on x's device in one go each."""
    vocab, device = x.shape[1], x.device
    allowed = [(row, seq.params.allowed_token_ids) for row, seq in rows if seq.params.allowed_token_ids is not None]
    if allowed:
        pairs = [(i, t) for i, (_, ids) in enumerate(allowed) for t in ids if 0 <= t < vocab]
        blocked = torch.ones(len(allowed), vocab, dtype=torch.bool, device=device)
        if pairs:
            blocked[torch.tensor(pairs, dtype=torch.long, device=device).unbind(1)] = False
        index = torch.tensor([row for row, _ in allowed], device=device)
        x.index_copy_(0, index, x.index_select(0, index).masked_fill_(blocked, -torch.inf))
    banned: list[tuple[int, int]] = []
    for row, seq in rows:
        output = seq.output_token_ids
        banned += [(row, word[-1]) for word in seq.params.bad_words_token_ids
                   if (len(word) == 1 or (len(word) - 1 <= len(output) and tuple(output[len(output) - len(word) + 1:]) == word[:-1]))
                   and 0 <= word[-1] < vocab]
    if banned:
        x.index_put_(torch.tensor(banned, dtype=torch.long, device=device).unbind(1), torch.tensor(-math.inf, device=device))


def _apply_grammar_masks(x: torch.Tensor, rows: list[int], states: list[GrammarState], *,
                         unpack_on_device: bool | None = None) -> None:
    """Set to -inf, in x (float32 [num_rows, vocab], modified in place), every token that rows[i]'s
    grammar does not allow next. All masks are computed in one call into one bitmask (bit t % 32
    of word t // 32: token t allowed). unpack_on_device (default: x off the CPU) sends the packed
    words to x's device and unpacks them there, 32 times less to copy than the bool mask; on the
    CPU numpy's unpackbits is the faster."""
    if not rows:
        return
    vocab = x.shape[1]
    words = (vocab + 31) // 32
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    states[0].executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bitmask.ctypes.data,
                                               words * 4, len(rows))
    if unpack_on_device if unpack_on_device is not None else not x.is_cpu:
        blocked = _blocked_from_bitmask(torch.from_numpy(bitmask).to(x.device), vocab)
    else:
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
        blocked = torch.from_numpy(~allowed)
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        x.masked_fill_(blocked.to(x.device), -torch.inf)
        return
    index = torch.tensor(rows, device=x.device)
    x[index] = x[index].masked_fill_(blocked.to(x.device), -torch.inf)


def _blocked_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 allow-bits -> [rows, vocab] bool, True where the token is not allowed
    (on the bitmask's device; an arithmetic shift still leaves bit 31 in the low bit)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(2) >> shifts).bitwise_and_(1)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] == 0


def _pick_greedy(x: torch.Tensor, rows: list[int]) -> _Picks:
    if not rows:
        return [], [], []
    ids, values = _row_max(_take(x, rows))
    return rows, ids, values


def _weights(xs: torch.Tensor, temperature: list[float], min_p: list[float]) -> tuple[torch.Tensor, list[float]]:
    """exp((x - max) / T) per row, the best token weighing 1, min_p-dropped and masked tokens 0;
    and each row's max logit (not finite: nothing left to sample, the row then weighs uniformly).
    min_p: prob < min_p * max_prob  <=>  weight < min_p, as the best token weighs 1."""
    device = xs.device
    min_p_t = torch.tensor(min_p, device=device) if any(p > 0 for p in min_p) else None
    weights, row_max = _weights_tensor(xs, torch.tensor(temperature, device=device), min_p_t)
    row_max_list = row_max.squeeze(1).tolist()
    dead = [i for i, value in enumerate(row_max_list) if not math.isfinite(value)]
    if dead:  # the caller reports these rows; keep the arithmetic finite meanwhile
        weights[torch.tensor(dead, device=device)] = 1.0
    return weights, row_max_list


def _weights_tensor(xs: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """_weights' arithmetic with [rows] float32 parameters (min_p None: no row has one): the
    weights (dead rows not yet reset) and the [rows, 1] row max."""
    row_max = xs.amax(dim=1, keepdim=True)
    weights = xs - row_max  # a new tensor: xs may be the caller's logits
    weights.div_(temperature.unsqueeze(1)).exp_()
    if min_p is not None:  # one in-place pass; rows without min_p have floor 0
        weights.masked_fill_(weights < min_p.unsqueeze(1), 0.0)
    return weights, row_max


def _uniforms(states: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    drawn = [next_uniform(s) for s in states]
    return torch.tensor([u for u, _ in drawn], dtype=torch.float64, device=device), [s for _, s in drawn]


def _draw(cumulative: torch.Tensor, u: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """First index whose cumulative weight exceeds u * total (default: the row's last cumulative
    value); u in [0, 1), total > 0. Never lands on a zero-weight entry."""
    total = cumulative[:, -1] if total is None else total
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target.unsqueeze(1), right=True).squeeze(1)


def _draw_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over each row in vocabulary order, in two stages so no [rows, vocab] float64
    tensor is ever built: pick a chunk of _CHUNK tokens by its (pairwise-summed) mass, then the
    token inside it by a float64 cumulative sum of that chunk alone."""
    rows, vocab = weights.shape
    if vocab <= _CHUNK:
        return _draw(torch.cumsum(weights, dim=1, dtype=torch.float64), u)
    num_full = vocab // _CHUNK
    sums = weights[:, : num_full * _CHUNK].reshape(rows, num_full, _CHUNK).sum(dim=2)
    if vocab % _CHUNK:
        sums = torch.cat([sums, weights[:, num_full * _CHUNK :].sum(dim=1, keepdim=True)], dim=1)
    chunk_cumulative = torch.cumsum(sums, dim=1, dtype=torch.float64)
    total = chunk_cumulative[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(chunk_cumulative, target.unsqueeze(1), right=True)  # [rows, 1]
    before = torch.cat([torch.zeros_like(chunk_cumulative[:, :1]), chunk_cumulative], dim=1).gather(1, chunk)
    cols = chunk * _CHUNK + torch.arange(_CHUNK, device=weights.device)
    local = weights.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    local_cumulative = torch.cumsum(local, dim=1, dtype=torch.float64)
    residual = (target.unsqueeze(1) - before).squeeze(1).clamp(min=0.0) / local_cumulative[:, -1]
    # the chunk's float32 sum and its float64 cumulative differ by rounding: _draw clamps
    index = _draw(local_cumulative, residual.clamp(max=1.0))
    return cols.gather(1, index.unsqueeze(1)).squeeze(1)


def _sample_full(weights: torch.Tensor, top_k: list[int], top_p: list[float], states: list[int]) -> torch.Tensor:
    """No truncation: inverse CDF over the whole row."""
    u, _ = _uniforms(states, weights.device)
    return _draw_from_weights(weights, u)


def _sample_top_k(weights: torch.Tensor, top_k: list[int], top_p: list[float], states: list[int]) -> torch.Tensor:
    """top_k, then top_p within it, then inverse CDF over the kept tokens best first.
    top_k >= vocab (or 0) means the whole row, sorted."""
    u, _ = _uniforms(states, weights.device)
    return _top_k_draw(weights, top_k, torch.tensor(top_p, dtype=torch.float64, device=weights.device), u)


def _top_k_draw(weights: torch.Tensor, top_k: list[int], top_p_t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """_sample_top_k with top_p as a [rows] float64 tensor and the rows' uniforms u [rows] float64."""
    vocab, device = weights.shape[1], weights.device
    top_k = [k if 0 < k < vocab else vocab for k in top_k]
    values, ids = torch.topk(weights, max(top_k), dim=1)  # best first
    beyond_k = torch.arange(values.shape[1], device=device) >= torch.tensor(top_k, device=device).unsqueeze(1)
    values.masked_fill_(beyond_k, 0.0)
    cumulative = torch.cumsum(values, dim=1, dtype=torch.float64)
    before = cumulative - values.double()  # mass strictly better than each token
    # a best-first prefix of each row; its first token always stays (before == 0, weight == 1)
    keep = (before < (top_p_t * cumulative[:, -1]).unsqueeze(1)) & (values > 0)
    kept_mass = cumulative.gather(1, (keep.sum(dim=1) - 1).unsqueeze(1)).squeeze(1)
    return ids.gather(1, _draw(cumulative, u, kept_mass).unsqueeze(1)).squeeze(1)


def _sample_top_p(weights: torch.Tensor, top_k: list[int], top_p: list[float], states: list[int]) -> torch.Tensor:
    """top_p by rejection, without sorting (_top_p_draw) on the rows' streams."""
    device = weights.device
    return _top_p_draw(weights, torch.tensor(top_p, dtype=torch.float64, device=device), UniformStreams(states, device))


def _top_p_draw(weights: torch.Tensor, top_p: torch.Tensor, streams: UniformStreams) -> torch.Tensor:
    """top_p by rejection, without sorting: draw among tokens heavier than the row's pivot; accept
    if the mass strictly heavier than the token is < top_p; else the token becomes the pivot.
    Round r draws with each row's r-th uniform; after round 0 only the rows still drawing are
    touched, the host learning which from one [rows still drawing] bool read per round."""
    device = weights.device
    threshold = top_p * weights.sum(dim=1).double()
    pivot = torch.full((weights.shape[0], 1), -1.0, device=device)
    picked = torch.zeros(weights.shape[0], dtype=torch.int64, device=device)
    active = list(range(weights.shape[0]))
    for round_index in range(_MAX_TOP_P_ROUNDS):
        idx = torch.tensor(active, device=device)
        sub = _take(weights, active)
        u = _take(streams.next(), active)  # every row's next draw: a row's r-th is the same either way
        allowed = sub if round_index == 0 else torch.where(sub > pivot[idx], sub, 0.0)
        token = _draw_from_weights(allowed, u).unsqueeze(1)
        value = sub.gather(1, token)
        heavier = torch.where(sub > value, sub, 0.0).sum(dim=1).double()
        accepted = (heavier < threshold[idx]).tolist()
        picked[idx] = token.squeeze(1)
        pivot[idx] = value
        active = [i for i, ok in zip(active, accepted) if not ok]
        if not active:
            return picked
    # pathological rows (many near-equal tokens around the cut): sort them
    idx = torch.tensor(active, device=device)
    picked[idx] = _top_k_draw(weights[idx], [0] * len(active), top_p[idx], _take(streams.next(), active))
    return picked


def _logprob_tensors(logits: torch.Tensor, rows: list[int], token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """For logits[rows]: the raw log-softmax of token_ids [len(rows)], and the k best (values, ids)."""
    logprobs = torch.log_softmax(_take(logits, rows), dim=1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if k > 0:
        values, ids = torch.topk(logprobs, k, dim=1)
    else:
        values, ids = logprobs[:, :0], torch.zeros_like(logprobs[:, :0], dtype=torch.int64)
    return chosen, values, ids


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], rows: list[int]
) -> list[TokenLogprob | None]:
    """Raw-model log-softmax of the sampled token and the k best alternatives, k = params.logprobs."""
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    ks = [min(seqs[row].params.logprobs or 0, logits.shape[1]) for row in rows]
    chosen_ids = torch.tensor([tokens[row] for row in rows], device=logits.device)
    chosen_t, values, ids = _logprob_tensors(logits, rows, chosen_ids, max(ks))
    chosen, top_values, top_ids = chosen_t.tolist(), values.tolist(), ids.tolist()
    for i, row in enumerate(rows):
        top = list(zip(top_ids[i][: ks[i]], top_values[i][: ks[i]]))
        out[row] = TokenLogprob(token_id=tokens[row], logprob=chosen[i], top=top)
    return out
