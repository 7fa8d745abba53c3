"""End-to-end fixtures: tiny real Llama 3 checkpoints and live servers on free ports.

The checkpoints are random weights in the real Meta format (params.json + consolidated.00.pth)
with the REAL Llama 3 tokenizer.model copied in, so the vocabulary must be Llama 3's 128256 tokens;
everything else is tiny (dim 64, 2 layers), about 68 MB on disk each. They are written once per
session, under one checkpoint root, named as `llama model download` names folders.

Servers run the real app (create_app + LocalEngineFactory) on an event loop in a background
thread, served by aiohttp's AppRunner on a free port, the way `python -m server` serves it; tests
talk to them over real sockets with the openai SDK and httpx. The engines run in float64: batch
invariance (batched greedy == alone) is exact there, in float32 a different batch shape may flip
a near-tied argmax (see ARCHITECTURE.md, test seams).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import httpx
import pytest

BASE_DESCRIPTOR = "Llama3.2-1B-Instruct"  # the family (llama3 chat format, tokenizer) of every e2e model
E2E_PARAMS = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128256,  # the real Llama 3 tokenizer's
    multiple_of=32,
    ffn_dim_multiplier=1.3,
    norm_eps=1e-5,
    rope_theta=500000.0,
    use_scaled_rope=True,
)
E2E_DTYPE = "float64"
KV_CACHE_BYTES = 8 << 20  # 512 blocks of 16 tokens at 1 KiB per token (float64): a few concurrent requests
MAX_SEQ_LEN = 512

T = TypeVar("T")


# --------------------------------------------------------------------------- checkpoints
def llama3_tokenizer_model() -> Path:
    """site-packages/llama_models/llama3/tokenizer.model, found without importing llama_models."""
    found = importlib.util.find_spec("llama_models")
    if found is None or not found.submodule_search_locations:
        pytest.skip("llama-models (a dev dependency) is not installed")
    path = Path(list(found.submodule_search_locations)[0]) / "llama3" / "tokenizer.model"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@dataclass
class Checkpoints:
    """Tiny Llama 3 checkpoints under one root, each written at most once per session."""

    root: Path  # the checkpoint root servers are given
    outside: Path  # a dir that is NOT a checkpoint root (for escape tests)
    _written: dict[str, Path] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, name: str, *, seed: int, num_shards: int = 1) -> Path:
        """<root>/<name> with random weights of `seed` (params.json as E2E_PARAMS), in `num_shards`
        consolidated.NN.pth files (the same full weights whatever their number)."""
        import torch

        from engine.loading.checkpoint import write_random_checkpoint
        from engine.models.args import ModelArgs

        out = self.root / name
        key = str(out)
        with self._lock:
            if key not in self._written:
                write_random_checkpoint(out, ModelArgs(**E2E_PARAMS), num_shards=num_shards, seed=seed,
                                        tokenizer_path=llama3_tokenizer_model(), dtype=torch.float32)
                self._written[key] = out
            return self._written[key]

    def outside_copy(self, name: str) -> Path:
        """<outside>/<name>: looks like a checkpoint (params.json, tokenizer, a shard) but lies outside
        the root. The server must refuse it before reading anything, so the shard is a stub."""
        source = self.get(BASE_DESCRIPTOR, seed=0)
        out = self.outside / name
        if not out.exists():
            out.mkdir()
            shutil.copy(source / "params.json", out / "params.json")
            shutil.copy(source / "tokenizer.model", out / "tokenizer.model")
            (out / "consolidated.00.pth").write_bytes(b"not read")
        return out

    def corrupt(self, name: str) -> Path:
        """A checkpoint dir whose only shard is truncated: params.json and tokenizer are fine."""
        source = self.get(BASE_DESCRIPTOR, seed=0)
        out = self.root / name
        if not out.exists():
            out.mkdir()
            shutil.copy(source / "params.json", out / "params.json")
            shutil.copy(source / "tokenizer.model", out / "tokenizer.model")
            data = (source / "consolidated.00.pth").read_bytes()
            (out / "consolidated.00.pth").write_bytes(data[: len(data) // 3])
        return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    base = tmp_path_factory.mktemp("e2e")
    (base / "checkpoints").mkdir()
    (base / "elsewhere").mkdir()
    return Checkpoints(root=base / "checkpoints", outside=base / "elsewhere")


@pytest.fixture(scope="session")
def base_checkpoint(checkpoints) -> Path:
    """<root>/Llama3.2-1B-Instruct: found by its descriptor name alone."""
    return checkpoints.get(BASE_DESCRIPTOR, seed=0)


def engine_config(**overrides: Any):
    from engine.config import EngineConfig

    base = dict(dtype=E2E_DTYPE, cpu_kv_cache_bytes=KV_CACHE_BYTES, max_seq_len=MAX_SEQ_LEN, max_batch_size=16,
                max_num_batched_tokens=256, seed=0)
    return EngineConfig(**{**base, **overrides})


# --------------------------------------------------------------------------- a live server
class LiveServer:
    """The real app on a free port, its event loop on a background thread."""

    def __init__(self, config, factory=None) -> None:
        self.config = config
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="e2e-server", daemon=True)
        self.app = None
        self._runner = None
        self.url = ""

    def start(self) -> "LiveServer":
        self._thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        from aiohttp import web

        from engine.loader import LocalEngineFactory
        from server.app import create_app

        factory = self._factory or LocalEngineFactory(self.config.engine, chat_template_path=self.config.chat_template)
        self.app = create_app(self.config, factory)
        # As server/drain.py's runner: a client that leaves cancels its handler.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.config.drain_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        """Run a coroutine on the server's loop (e.g. to read the registry) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    @property
    def registry(self):
        from server.registry import REGISTRY_KEY

        return self.app[REGISTRY_KEY]

    # ---------------------------------------------------------------- clients
    def openai(self, api_key: str = "none", **kwargs: Any):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)


@contextlib.contextmanager
def ready_server(model_id: str, checkpoint_dir: Path, checkpoints_root: Path, *,
                 server_settings: dict[str, Any] | None = None, factory: Any = None,
                 **engine_overrides: Any) -> Iterator[LiveServer]:
    """A LiveServer serving one trusted model, yielded once /ready answers 200; `server_settings` are
    further ServerConfig fields, `factory` an EngineFactory instead of LocalEngineFactory."""
    from server.config import ServerConfig
    from server.model_spec import ModelSpec

    config = ServerConfig(
        models=[ModelSpec(model_id=model_id, checkpoint_dir=checkpoint_dir, trusted=True)],
        checkpoint_roots=[checkpoints_root],
        engine=engine_config(**engine_overrides),
        drain_timeout_s=5.0,
        **(server_settings or {}),
    )
    live = LiveServer(config, factory).start()
    try:
        with live.http() as http:
            wait_until(lambda: http.get("/ready").status_code == 200, timeout_s=120, interval_s=0.1, what="/ready")
        yield live
    finally:
        live.stop()


@contextlib.contextmanager
def empty_server(checkpoints_root: Path) -> Iterator[LiveServer]:
    """A LiveServer with no model registered (tests register theirs over the API), reading
    checkpoints under `checkpoints_root`; a first request waits up to a minute for a load."""
    from server.config import ServerConfig

    config = ServerConfig(models=[], checkpoint_roots=[checkpoints_root], engine=engine_config(), load_wait_timeout_s=60)
    live = LiveServer(config).start()
    try:
        yield live
    finally:
        live.stop()


def wait_until(predicate: Callable[[], T], *, timeout_s: float, interval_s: float = 0.05, what: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


def wait_answering(http: httpx.Client, process: subprocess.Popen, log_path: Path, path: str, *, timeout_s: float,
                   interval_s: float, what: str) -> None:
    """Poll GET `path` until it answers 200; a server process that exits meanwhile fails the wait at
    once, with its log's tail."""

    def answering() -> bool:
        assert process.poll() is None, f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
        try:
            return http.get(path).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answering, timeout_s=timeout_s, interval_s=interval_s, what=what)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """GET /metrics -> {(name, frozenset of (label, value)): value}."""
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    out = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
        out[(match.group("name"), labels)] = float(match.group("value"))
    return out


def metric(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


# --------------------------------------------------------------------------- expectations and memory
def expected_greedy_texts(checkpoint_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy completions of token-id prompts computed by an engine loaded straight from the
    checkpoint (no server, no registry), one prompt at a time."""
    from engine.loader import load_engine
    from engine.types import EngineRequest, SamplingParams
    from server.model_spec import ModelSpec

    spec = ModelSpec(model_id="expected", checkpoint_dir=checkpoint_dir, llama_model=BASE_DESCRIPTOR, trusted=True)

    async def run() -> list[str]:
        engine = load_engine(spec, engine_config())
        try:
            texts = []
            for i, prompt in enumerate(prompts):
                request = EngineRequest(f"expected-{i}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
                texts.append("".join([out.text_delta async for out in engine.generate(request)]))
            return texts
        finally:
            await engine.shutdown()

    return asyncio.run(run())


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size, from /proc/self/statm (field 2, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE_BYTES


def release_freed_memory() -> None:
    """Collect cycles, then ask glibc to hand freed heap pages back to the kernel: without
    malloc_trim, memory freed in small chunks can stay in the process and hide a real unload."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then drops only for mmapped blocks
        pass

