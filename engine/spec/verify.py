"""Verification of draft tokens against the target model's logits (one forward over 1 + k rows).

Proposals here are deterministic (prompt lookup, a greedy draft model), so the draft distribution q
is one-hot on the proposed token x, and standard speculative rejection sampling reduces to: accept x
with probability min(1, p(x)/q(x)) = p(x); on rejection draw from normalize(max(0, p - q)), which is
p with x removed. Every emitted token is then distributed exactly as the target's p given the
tokens before it (P(x) = p(x); P(y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y)). Greedy rows accept
while the draft equals the row's argmax and emit the argmax at the first mismatch, so greedy output
is the output without speculation.

p is the sampler's target distribution (engine/core/sampler.py): softmax(logits / T), then min_p,
top_k, top_p, each keeping every token tied at its cut. Sequences whose logits the sampler modifies
further (penalties, bias, masks, grammars, logprobs) never speculate (engine/spec/speculator.py).
Randomness: seeded rows use per-position streams of the seed (sampler.seeded_state, offset so they
never coincide with the sampler's own), so a seeded result depends only on the seed and the logits.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from engine.core.sampler import is_greedy, next_uniform, seeded_state
from engine.types import SamplingParams

_SPEC_STREAM = 0x5BEC_DEC0  # offsets the verifier's seeded streams from the sampler's


@dataclass(slots=True)
class Verdict:
    num_accepted: int  # leading draft tokens accepted
    correction: int | None  # the token drawn at the first rejection; None when all were accepted


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, vocab] float64 probabilities the sampler draws from, for a sampled (T > 0) row set."""
    x = logits.double() / params.temperature
    probs = torch.softmax(x, dim=1)
    if params.min_p > 0:
        best = probs.amax(dim=1, keepdim=True)
        probs = torch.where(probs < params.min_p * best, 0.0, probs)
    vocab = probs.shape[1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(probs, params.top_k, dim=1).values[:, -1:]
        probs = torch.where(probs < kth, 0.0, probs)
    if params.top_p < 1:
        values, _ = torch.sort(probs, dim=1, descending=True)
        # mass strictly heavier than each token: ties share the exclusive sum of their first member
        exclusive = torch.cumsum(values, dim=1) - values
        first_of_value = torch.searchsorted(-values.contiguous(), -probs, right=False)
        heavier = exclusive.gather(1, first_of_value.clamp(max=vocab - 1))
        threshold = params.top_p * probs.sum(dim=1, keepdim=True)
        probs = torch.where(heavier < threshold, probs, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def _draw(weights: torch.Tensor, u: float) -> int:
    cumulative = torch.cumsum(weights, dim=0)
    total = float(cumulative[-1])
    index = int(torch.searchsorted(cumulative, torch.tensor([u * total], dtype=cumulative.dtype, device=cumulative.device), right=True))
    index = min(index, weights.shape[0] - 1)
    while weights[index] <= 0 and index > 0:  # rounding at the top end: step back onto mass
        index -= 1
    return index


def greedy_verdict(targets: list[int], drafts: list[int]) -> Verdict:
    """Greedy verification from each row's argmax: accept while the draft is the argmax; the
    argmax at the first mismatch is the correction."""
    for j, (draft, target) in enumerate(zip(drafts, targets)):
        if draft != target:
            return Verdict(j, target)
    return Verdict(len(drafts), None)


class Verifier:
    """Decides how many draft tokens each speculating sequence keeps."""

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed ^ _SPEC_STREAM)  # unseeded rows share it

    def verify(self, logits: torch.Tensor, drafts: list[int], params: SamplingParams, num_output_tokens: int) -> Verdict:
        """logits: [k, vocab], row j the target's logits for the token after draft j (row 0: after the
        last committed token); drafts: the k proposed tokens; num_output_tokens: generated so far."""
        if is_greedy(params):
            return greedy_verdict(logits.argmax(dim=1).tolist(), drafts)
        probs = target_probs(logits, params)
        for j, draft in enumerate(drafts):
            state = (seeded_state(params.seed ^ _SPEC_STREAM, num_output_tokens + j) if params.seed is not None
                     else self._rng.getrandbits(64))
            u_accept, state = next_uniform(state)
            p_draft = float(probs[j, draft])
            if u_accept < p_draft:
                continue
            residual = probs[j].clone()
            residual[draft] = 0.0
            if not math.isfinite(float(residual.sum())) or float(residual.sum()) <= 0:
                return Verdict(j, draft)  # p(draft) == 1 up to rounding: nothing else could be drawn
            u_draw, _ = next_uniform(state)
            return Verdict(j, _draw(residual, u_draw))
        return Verdict(len(drafts), None)
