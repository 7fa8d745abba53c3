"""test_engine_real's whole-engine checks on a tiny Llama 4 checkpoint (chunk size 8, prompts up
to 30 tokens plus a 17-token shared prefix): batching, chunked prefill, preemption (recompute)
and prefix-cache hits never change a request's greedy tokens."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_real import (  # noqa: F401 (collected here, with this module's `spec`)
    Alone,
    test_16_concurrent_greedy_requests_equal_each_alone,
    test_with_a_pool_small_enough_to_force_preemption,
    test_with_prefix_cache_hits,
)
from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR, write_tiny_llama4_checkpoint


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from engine.loading.checkpoint import resolve_checkpoint

    ckpt = write_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_engine"))
    return resolve_checkpoint(ckpt, model_id="tiny", llama_model=TINY_LLAMA4_DESCRIPTOR)


@pytest.fixture(scope="module")
def alone_engine(spec):
    alone = Alone(spec)
    yield alone
    alone.core.runner.shutdown()
