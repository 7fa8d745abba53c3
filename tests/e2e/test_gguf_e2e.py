"""A .gguf file registered as checkpoint_dir on a live server (issue 30): it serves the greedy
tokens of the same GGUF imported offline, the second registration uses the cached conversion, and
a GGUF reached through a link out of the checkpoint roots is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveServer, engine_config

gguf = pytest.importorskip("gguf")
from tests.engine.test_gguf_import import PROMPT, hf_weights, write_gguf  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf_e2e")
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    write_gguf(root / "tiny.gguf", hf_weights(seed=1, tied=False))
    write_gguf(outside / "secret.gguf", hf_weights(seed=2, tied=False))
    (root / "escape.gguf").symlink_to(outside / "secret.gguf")
    return tmp, root


@pytest.fixture(scope="module")
def server(setup):
    from server.config import ServerConfig

    tmp, root = setup
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMASERVE_CACHE_DIR", str(tmp / "cache"))
        live = LiveServer(ServerConfig(models=[], checkpoint_roots=[root], engine=engine_config(dtype="float32"))).start()
        yield live
        live.stop()


def expected_text(tmp: Path, root: Path) -> str:
    """The greedy completion from the GGUF imported offline (import-gguf) and loaded without a server."""
    from engine.loader import load_engine
    from engine.loading.gguf_import import import_gguf
    from engine.types import EngineRequest, SamplingParams
    from server.model_spec import ModelSpec

    checkpoint = import_gguf(root / "tiny.gguf", tmp / "offline", progress=False)

    async def run() -> str:
        engine = load_engine(ModelSpec(model_id="offline", checkpoint_dir=checkpoint, trusted=True), engine_config(dtype="float32"))
        try:
            request = EngineRequest("e", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            return "".join([out.text_delta async for out in engine.generate(request)])
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def complete(http, model: str) -> str:
    response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "temperature": 0,
                                                  "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_gguf_file_registered_serves_and_second_load_uses_the_cache(server, setup):
    tmp, root = setup
    want = expected_text(tmp, root)
    with server.http() as http:
        first = http.post("/v1/models", json={"model_id": "tiny-gguf", "checkpoint_dir": "tiny.gguf"})
        assert first.status_code == 200, first.text
        assert first.json()["status"] == "ready"
        assert complete(http, "tiny-gguf") == want
        converted = [p for p in (tmp / "cache" / "gguf").iterdir() if p.is_dir()]
        assert len(converted) == 1
        params_mtime = (converted[0] / "params.json").stat().st_mtime_ns
        second = http.post("/v1/models", json={"model_id": "tiny-gguf-again", "checkpoint_dir": str(root / "tiny.gguf")})
        assert second.status_code == 200, second.text
        assert complete(http, "tiny-gguf-again") == want
        assert [p for p in (tmp / "cache" / "gguf").iterdir() if p.is_dir()] == converted  # no second conversion
        assert (converted[0] / "params.json").stat().st_mtime_ns == params_mtime
        for model in ("tiny-gguf", "tiny-gguf-again"):
            assert http.delete(f"/v1/models/{model}").status_code == 200


def test_gguf_linked_out_of_the_roots_is_refused(server):
    with server.http() as http:
        response = http.post("/v1/models", json={"model_id": "escape", "checkpoint_dir": "escape.gguf"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "checkpoint_dir_outside_roots" and error["param"] == "checkpoint_dir"
        assert "secret" not in error["message"]
