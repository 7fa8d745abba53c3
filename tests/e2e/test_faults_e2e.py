"""Faults on a tiny real model (issue 16): a storm of clients that leave at random points must leave
the engine idle with every KV block free, read from /metrics as an operator would."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, metric, ready_server, scrape, wait_until

MODEL = BASE_DESCRIPTOR
NUM_STREAMS = 200
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello wörld ✓"]

pytestmark = pytest.mark.timeout(600)


async def one_client(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    """A streamed completion the client drops after a random number of events (or reads to the
    end, one time in five); returns how it ended."""
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS) * rng.randint(1, 8), "temperature": 0,
            "max_tokens": rng.randint(4, 64), "stream": True}
    read_to_end = rng.random() < 0.2
    drop_after = rng.randint(0, 12)
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return f"status {response.status}"
        events = 0
        async for line in response.content:
            if line.startswith(b"data: "):
                events += 1
                if line.startswith(b"data: [DONE]"):
                    return "complete"
                if not read_to_end and events > drop_after:
                    response.close()  # the client leaves mid-stream
                    return "dropped"
    return "ended"


async def storm(url: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    clients = [random.Random(rng.random()) for _ in range(NUM_STREAMS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(one_client(session, url, client_rng)) for client_rng in clients]
        # some clients go away before their first byte arrives: cancel a few tasks right after they start
        await asyncio.sleep(0)
        for task in tasks[::10]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return ["cancelled" if isinstance(r, asyncio.CancelledError) else r if isinstance(r, str) else repr(r)
            for r in results]


def test_disconnect_storm_leaves_no_request_and_no_kv_block_behind(base_checkpoint, checkpoints):
    with ready_server(MODEL, base_checkpoint, checkpoints.root, max_batch_size=32) as server, server.http() as http:
        outcomes = asyncio.run(storm(server.url, seed=16))
        assert all(o in ("complete", "dropped", "cancelled") for o in outcomes), sorted(set(outcomes))
        assert outcomes.count("dropped") > NUM_STREAMS // 2 and outcomes.count("complete") > 0

        def engine_state() -> tuple:
            samples = scrape(http)
            return tuple(metric(samples, name, model_name=MODEL) for name in (
                "llamaserve:num_requests_running", "llamaserve:num_requests_waiting", "llamaserve:kv_cache_usage_perc"))

        wait_until(lambda: engine_state() == (0.0, 0.0, 0.0), timeout_s=10,
                   what="running = waiting = 0 and every KV block free after the storm")
        # and the engine still serves
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200, response.text
