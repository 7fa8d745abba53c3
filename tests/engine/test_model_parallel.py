"""MODEL_PARALLEL_SIZE=2 on CPU (gloo, one spawned follower) against size 1 on the same weights.

Each case spawns one process; sizes are tiny and each executor runs one short schedule.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.types import EngineDead, InvalidRequest
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

pytestmark = pytest.mark.timeout(240)

PROMPT_LENGTHS = [3, 9, 14]


def _run(checkpoint, mp_size: int, dtype: str):
    executor = make_executor(checkpoint, mp_size=mp_size, dtype=dtype)
    followers = list(executor._group.processes) if mp_size > 1 else []
    try:
        return run_random_schedule(executor, random_prompts(256, PROMPT_LENGTHS, seed=21), seed=21, max_new=4)
    finally:
        executor.shutdown()
        assert [p.exitcode for p in followers] == [0] * len(followers)  # STOP ends them cleanly


@pytest.fixture(scope="module")
def mp1_results(tiny_checkpoint):
    return {dtype: _run(tiny_checkpoint, 1, dtype) for dtype in ("float64", "float32")}


@pytest.mark.parametrize(
    "shards, dtype, tolerance",
    [
        ("1->2", "float64", 1e-9),
        ("2->2", "float64", 1e-9),
        ("2->1", "float64", 1e-9),
        ("1->2", "float32", 1e-4),  # the production path: oneDNN-packed linears plus collectives
    ],
)
def test_mp_matches_single_process(request, mp1_results, shards, dtype, tolerance):
    """Same greedy tokens and near-identical logits, whatever the saved and the run sizes."""
    saved, run = (int(x) for x in shards.split("->"))
    checkpoint = request.getfixturevalue("tiny_checkpoint" if saved == 1 else "tiny_checkpoint_2shards")
    results = _run(checkpoint, run, dtype)
    for seq_id, (logits, tokens) in mp1_results[dtype].items():
        other_logits, other_tokens = results[seq_id]
        assert other_tokens == tokens
        torch.testing.assert_close(other_logits, logits, atol=tolerance, rtol=tolerance)


def test_dead_worker_is_reported(tiny_checkpoint):
    executor = make_executor(tiny_checkpoint, mp_size=2)
    try:
        with pytest.raises(InvalidRequest, match="another model with model_parallel_size > 1 is loaded"):
            make_executor(tiny_checkpoint, mp_size=2)  # one model-parallel group per process
        follower = executor._group.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(30)
        with pytest.raises(EngineDead, match="rank 1"):
            run_random_schedule(executor, random_prompts(256, [5], seed=1), seed=1, max_new=1)
        with pytest.raises(EngineDead):  # stays dead
            run_random_schedule(executor, random_prompts(256, [5], seed=1), seed=1, max_new=1)
    finally:
        executor.shutdown()  # must not hang on the dead follower
    assert not follower.is_alive()
