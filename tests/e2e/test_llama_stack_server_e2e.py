"""Issue 20: `llama stack run` (llama-stack 0.7.x, in its own venv: its pins clash with
llama-stack-client 0.2.x) with its remote vLLM provider pointed at live llamaservers: it lists our
models and serves chat, streamed and not, and tool calls through them.

Two llamaservers sit behind one stack: a tiny random Llama 3.2 checkpoint (answers must equal the
server's own at temperature 0) and the real Llama 3.2 chat format over a scripted engine that answers
with a tool call (random weights never call one), whose recorded prompt must equal the one the same
request renders when sent to us directly.

.ci/run creates the venv and sets LLAMA_STACK_TEST_VENV; without it (a bare local run) this skips.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, LiveServer, ready_server, wait_until

pytestmark = pytest.mark.slow

VENV_ENV = "LLAMA_STACK_TEST_VENV"
STARTUP_TIMEOUT_S = 180
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def _llama_cli() -> Path:
    venv = os.environ.get(VENV_ENV)
    if not venv:
        pytest.skip(f"{VENV_ENV} is not set: .ci/run creates the llama-stack 0.7 venv and sets it")
    cli = Path(venv) / "bin" / "llama"
    assert cli.is_file(), f"{VENV_ENV}={venv} has no bin/llama: install llama-stack there (.ci/run does)"
    return cli


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stack_config(tmp: Path, port: int, upstreams: dict[str, str]) -> Path:
    """A run config (version 2) with one remote::vllm provider per llamaserve, storage under tmp."""
    providers = [{"provider_id": name, "provider_type": "remote::vllm", "config": {"base_url": f"{url}/v1", "max_tokens": 64}}
                 for name, url in upstreams.items()]
    config = {
        "version": 2, "distro_name": "llamaserve-e2e", "apis": ["inference"], "providers": {"inference": providers},
        "storage": {
            "backends": {"kv_default": {"type": "kv_sqlite", "db_path": str(tmp / "kv.db")},
                         "sql_default": {"type": "sql_sqlite", "db_path": str(tmp / "sql.db")}},
            "stores": {"metadata": {"backend": "kv_default", "namespace": "registry"},
                       "inference": {"backend": "sql_default", "table_name": "inference_store"},
                       "conversations": {"backend": "sql_default", "table_name": "openai_conversations"},
                       "prompts": {"backend": "kv_default", "namespace": "prompts"},
                       "connectors": {"backend": "kv_default", "namespace": "connectors"}}},
        "registered_resources": {"models": [], "shields": [], "vector_stores": [], "datasets": [], "scoring_fns": [],
                                 "benchmarks": [], "tool_groups": []},
        "server": {"port": port},
    }
    path = tmp / "run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def llamaserve(base_checkpoint, checkpoints):
    with ready_server(BASE_DESCRIPTOR, base_checkpoint, checkpoints.root) as live:
        yield live


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A llamaserve whose engine answers `[get_weather(city="Paris")]` in the Llama 3.2 chat format."""
    from server.config import ServerConfig
    from tests.engine.tokenizer_fixtures import real_llama3
    from tests.server.fake_engine import fake_spec
    from tests.server.test_api_real_formats import Factory
    from tests.server.test_llama_stack_api import call_script, engine_for

    root = tmp_path_factory.mktemp("scripted")
    engine = engine_for("llama3_2", call_script(real_llama3(), "<|eot_id|>"))
    live = LiveServer(ServerConfig(models=[fake_spec("llama", root)], checkpoint_roots=[root], drain_timeout_s=5.0),
                      factory=Factory(engine)).start()
    try:
        with live.http() as http:
            wait_until(lambda: http.get("/ready").status_code == 200, timeout_s=60, what="/ready")
        yield live, engine
    finally:
        live.stop()


@pytest.fixture(scope="module")
def stack(llamaserve, scripted, tmp_path_factory):
    """`llama stack run` on a free port; its base URL once /v1/models lists both upstreams' models."""
    cli = _llama_cli()
    tmp = tmp_path_factory.mktemp("llama-stack")
    port = _free_port()
    config = stack_config(tmp, port, {"llamaserve": llamaserve.url, "scripted": scripted[0].url})
    env = {**os.environ, "HOME": str(tmp)}  # the stack writes under ~/.llama
    log = (tmp / "stack.log").open("w")
    process = subprocess.Popen([str(cli), "stack", "run", str(config), "--port", str(port)], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            def listed() -> set[str]:
                assert process.poll() is None, (tmp / "stack.log").read_text()[-4000:]
                try:
                    return {m["id"] for m in http.get("/v1/models").json()["data"]}
                except (httpx.HTTPError, ValueError, KeyError):
                    return set()

            wait_until(lambda: len(listed()) == 2, timeout_s=STARTUP_TIMEOUT_S, interval_s=0.5,
                       what="llama stack to list both llamaservers' models")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def client(stack):
    import openai

    with openai.OpenAI(base_url=f"{stack}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
        yield sdk


MODEL = f"llamaserve/{BASE_DESCRIPTOR}"


def test_stack_lists_our_models(stack):
    models = httpx.get(f"{stack}/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert set(by_id) == {MODEL, "scripted/llama"}
    assert by_id[MODEL]["custom_metadata"]["provider_resource_id"] == BASE_DESCRIPTOR


def test_chat_through_the_stack_equals_ours(client, llamaserve):
    with llamaserve.openai() as ours:
        expected = ours.chat.completions.create(model=BASE_DESCRIPTOR, messages=ASK, temperature=0, max_tokens=12)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens

    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected.choices[0].message.content

    completion = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8)
    with llamaserve.openai() as ours:
        direct = ours.completions.create(model=BASE_DESCRIPTOR, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert completion.choices[0].text == direct.choices[0].text


def test_tool_call_through_the_stack(client, scripted):
    live, engine = scripted
    engine.requests.clear()
    answer = client.chat.completions.create(model="scripted/llama", messages=ASK, tools=TOOLS, temperature=0, max_tokens=32)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(model="scripted/llama", messages=ASK, tools=TOOLS, temperature=0,
                                            max_tokens=32, stream=True)
    deltas = [tc for chunk in stream if chunk.choices for tc in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}

    # The result goes back through the stack; what reaches us renders as the same request sent directly.
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    engine.requests.clear()
    client.chat.completions.create(model="scripted/llama", messages=follow_up, tools=TOOLS, temperature=0, max_tokens=32)
    with live.openai() as ours:
        ours.chat.completions.create(model="llama", messages=follow_up, tools=TOOLS, temperature=0, max_tokens=32)
    via_stack, direct = engine.requests
    assert via_stack.prompt_token_ids == direct.prompt_token_ids
