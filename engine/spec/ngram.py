"""Prompt-lookup (n-gram) proposals, as vLLM's ngram proposer: find the longest suffix of the
sequence's own tokens (prompt + output), between prompt_lookup_max and prompt_lookup_min tokens
long, that occurred earlier in it, and propose the k tokens that followed that occurrence.
Where the suffix occurred several times the latest occurrence wins (the text being copied now).
numpy over the token list: a few vector compares per step, no model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, *, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k draft tokens continuing token_ids; [] when no suffix of lookup_min..lookup_max tokens
    occurred before."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, num_tokens - 1), lookup_min - 1, -1):
        # windows that start at i < num_tokens - n: each is followed by at least one token and is
        # not the suffix itself
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []
