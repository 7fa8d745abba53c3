"""CPU resident memory: why a serving process plateaus early and then stays flat.

Under mixed prompt lengths with chunked prefill a step carries any token count from 1 to the step
budget. oneDNN creates, and caches (up to ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default), a
primitive with its own buffers for every distinct row count M of a packed linear, and glibc keeps
the memory its scratch buffers were freed into: a 2,000-request soak's resident memory grew 12.8%
after its first 200 requests, still meeting new M values (bench/NOTES.md, "Soak").

onednn_rows() pads a packed linear's rows up to a few buckets, so a handful of primitives per
weight shape serve every step: they are all created early, and memory stops growing once they are.
The padding costs little: rows at most 16 (decode batches, where a call streams the weight and
padding would add a real share of the work) stay exact; above that rows go up to a multiple of 16
(AMX's tile height), and past 128 rows to at most 1/8 more, where the multiply is compute-bound
(bench/step_memory.py measures both memory and speed).
"""

from __future__ import annotations

# Row counts up to this run at their own size: a decode batch's rows cost a share of the weight
# stream each, padding them would be paid on every decode step.
EXACT_ROWS = 16
# Buckets per doubling of the row count: 8 bounds the padding at 1/8 of the rows.
BUCKETS_PER_OCTAVE = 8
ROW_ALIGNMENT = 16


def onednn_rows(rows: int) -> int:
    """The row count a packed oneDNN linear runs at for `rows` input rows (>= rows): rows itself up
    to EXACT_ROWS, then the next multiple of max(16, 2^k / 8) for rows in (2^k, 2^(k+1)]. Up to
    512 rows that is 39 sizes instead of 512."""
    if rows <= EXACT_ROWS:
        return rows
    octave_start = 1 << ((rows - 1).bit_length() - 1)  # the power of two just below rows
    step = max(ROW_ALIGNMENT, octave_start // BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step
