"""Issue 29 (4): the Batch API puts sequences (n x prompts of each item) in flight, not items, so items
with a large n cannot fill the engine's queue."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.batch_runner import BATCH_PRIORITY, item_sequences
from tests.server.fake_engine import FakeEngineFactory, Hold
from tests.server.test_batch_api import _true, chat_line, create, poll, start


@pytest.fixture
def factory() -> FakeEngineFactory:
    return FakeEngineFactory()


def body(**fields) -> bytes:
    return json.dumps({"model": "fake", **fields}).encode()


@pytest.mark.parametrize("fields,expected", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 1),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 32}, 32),
    ({"prompt": "one", "n": 3}, 3),
    ({"prompt": ["a", "b", "c"], "n": 2}, 6),
    ({"prompt": [1, 2, 3], "n": 2}, 2),  # one token-id prompt
    ({"prompt": [[1], [2]], "n": None}, 2),  # null n is the default, 1
    ({"prompt": 5, "n": "x"}, 1),  # refused when planned: it never reaches the engine
])
def test_item_sequences(fields, expected):
    assert item_sequences(body(**fields)) == expected


async def test_sequences_in_flight_not_items(aiohttp_client, factory, tmp_path):
    client = await start(aiohttp_client, factory, tmp_path, batch_max_in_flight=4)
    engine = factory.engines["fake"]
    engine.hold = Hold(after=1)
    await create(client, [chat_line(f"c{i}", n=2) for i in range(6)])
    await poll(lambda: _true(len(engine.requests) >= 4), what="two items (four sequences) in the engine")
    online = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "x"}]}))
    await poll(lambda: _true(engine.requests[-1].priority == 0), what="the online request in the engine")
    # Two items of n=2 are the four sequences in flight; a third item waits (it was let in before: items counted).
    assert [request.priority for request in engine.requests] == [BATCH_PRIORITY] * 4 + [0]
    engine.hold.release.set()
    assert (await online).status == 200
