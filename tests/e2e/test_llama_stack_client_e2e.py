"""Issue 20: llama-stack-client 0.2.x, unmodified, against a live server on a tiny Llama 3.2 checkpoint:
the real CLI as a subprocess (models register / list, inference chat-completion) and the Python
SDK (chat, streamed and not, completion, both batch calls), whose greedy answers must equal the
OpenAI endpoints'. Multi-turn tool calls through the native API render the same prompt tokens as
through the OpenAI API (the engine's requests are recorded), on Llama 3.2 and, once its
checkpoints load (issue 15), Llama 4."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, E2E_PARAMS, ready_server
from tests.server.test_llama_stack_api import NATIVE_TOOLS, OPENAI_TOOLS

llama_stack_client = pytest.importorskip("llama_stack_client")
pytestmark = pytest.mark.slow

MODEL = BASE_DESCRIPTOR
CLI_TIMEOUT_S = 120
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
CONVERSATIONS = [[{"role": "user", "content": "Name a colour."}],
                 [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]]
GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(base_checkpoint, checkpoints):
    with ready_server(MODEL, base_checkpoint, checkpoints.root) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return llama_stack_client.LlamaStackClient(base_url=server.url, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    with server.openai() as client:
        yield client


def run_cli(server, *args: str) -> tuple[int, str]:
    """`llama-stack-client --endpoint URL ARGS...`, as a user types it: exit code and output without colours."""
    exe = shutil.which("llama-stack-client")
    command = [exe] if exe else [sys.executable, "-m", "llama_stack_client.lib.cli.llama_stack_client"]
    done = subprocess.run([*command, "--endpoint", server.url, *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "400"})
    return done.returncode, ANSI.sub("", done.stdout + done.stderr)


def cli(server, *args: str) -> str:
    code, output = run_cli(server, *args)
    assert code == 0, output
    assert "Failed to" not in output, output  # the CLI prints errors in a panel and still exits 0
    return output


def openai_chat(oai, messages, max_tokens: int | None = 12, **kwargs) -> str:
    response = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs)
    return response.choices[0].message.content or ""


def openai_completion(oai, prompt: str, max_tokens: int = 12) -> str:
    return oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens).choices[0].text


# --------------------------------------------------------------------------- the CLI
def test_cli_register_list_and_chat(server, checkpoints, oai):
    plain = "Llama3.2-3B-Instruct"  # a descriptor with a folder of its own under the root
    checkpoints.get(plain, seed=3)
    custom = "my-finetune-cli"
    metadata = json.dumps({"llama_model": BASE_DESCRIPTOR, "skip_initialize": True})
    with server.http() as http:
        try:
            assert "Successfully registered model " + plain in cli(server, "models", "register", plain)
            assert http.get(f"/v1/models/{plain}").json()["status"] == "ready"  # loaded: no skip_initialize
            output = cli(server, "models", "register", custom, "--metadata", metadata)
            assert "Successfully registered model " + custom in output
            info = http.get(f"/v1/models/{custom}").json()
            assert info["status"] == "registered" and info["llama_model"] == BASE_DESCRIPTOR
            assert info["metadata"] == {"llama_model": BASE_DESCRIPTOR, "skip_initialize": True}

            listing = cli(server, "models", "list")
            assert "Total models: 3" in listing
            for model_id in (MODEL, plain, custom):
                assert model_id in listing

            # The habit from meta-reference days: no --model-id, the CLI takes the first listed llm.
            first = http.get("/v1/models").json()["data"][0]["id"]
            assert first in (MODEL, plain, custom)
            answer = cli(server, "inference", "chat-completion", "--message", "hello, what model are you?")
            assert "completion_message" in answer and "stop_reason" in answer
            streamed = cli(server, "inference", "chat-completion", "--model-id", MODEL, "--stream",
                           "--message", "hello, what model are you?")
            reference = oai.chat.completions.create(model=MODEL, temperature=0,
                                                    messages=[{"role": "user", "content": "hello, what model are you?"}])
            assert streamed.startswith("Assistant> ")
            assert reference.choices[0].message.content in streamed
        finally:
            for model_id in (plain, custom):
                http.delete(f"/v1/models/{model_id}")


def test_cli_prints_errors_it_can_read(server):
    _, output = run_cli(server, "models", "register", "no-such-model")
    assert "Failed to register model" in output and "Error code: 400" in output
    assert "no checkpoint found for model 'no-such-model'" in output and "checkpoint_not_found" in output


# --------------------------------------------------------------------------- the Python SDK
def test_sdk_chat_equals_openai(sdk, oai):
    for messages in CONVERSATIONS:
        expected = openai_chat(oai, messages)
        response = sdk.inference.chat_completion(model_id=MODEL, messages=messages, sampling_params=GREEDY)
        assert response.completion_message.content == expected
        assert response.completion_message.role == "assistant"
        assert response.completion_message.stop_reason in ("end_of_turn", "out_of_tokens")
        usage = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12).usage
        metrics = {m.metric: m.value for m in response.metrics}
        assert metrics == {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.total_tokens}

        chunks = list(sdk.inference.chat_completion(model_id=MODEL, messages=messages, sampling_params=GREEDY, stream=True))
        kinds = [chunk.event.event_type for chunk in chunks]
        assert kinds[0] == "start" and kinds[-1] == "complete" and set(kinds[1:-1]) <= {"progress"}
        text = "".join(c.event.delta.text for c in chunks if c.event.event_type == "progress")
        assert text == expected and chunks[-1].event.stop_reason == response.completion_message.stop_reason


def test_sdk_chat_logprobs_and_top_p_strategy(sdk, oai):
    messages = CONVERSATIONS[0]
    response = sdk.inference.chat_completion(model_id=MODEL, messages=messages, sampling_params=GREEDY,
                                             logprobs={"top_k": 2})
    reference = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                            logprobs=True, top_logprobs=2)
    assert [lp.logprobs_by_token for lp in response.logprobs] == [
        {top.token: top.logprob for top in token.top_logprobs} for token in reference.choices[0].logprobs.content]
    seeded = {"strategy": {"type": "top_p", "temperature": 0.8, "top_p": 0.9}, "max_tokens": 8}
    response = sdk.inference.chat_completion(model_id=MODEL, messages=messages, sampling_params=seeded)
    assert response.completion_message.stop_reason in ("end_of_turn", "out_of_tokens")


def test_sdk_completion_equals_openai(sdk, oai):
    for prompt in PROMPTS:
        expected = openai_completion(oai, prompt)
        response = sdk.inference.completion(model_id=MODEL, content=prompt, sampling_params=GREEDY)
        assert response.content == expected
        assert response.stop_reason == "out_of_tokens" or len(response.content) < 200
        streamed = list(sdk.inference.completion(model_id=MODEL, content=prompt, sampling_params=GREEDY, stream=True))
        assert "".join(chunk.delta for chunk in streamed) == expected
        assert streamed[-1].stop_reason == response.stop_reason


def test_sdk_batch_calls_equal_openai(sdk, oai, server):
    batch = sdk.inference.batch_completion(model_id=MODEL, content_batch=PROMPTS, sampling_params=GREEDY)
    assert [item.content for item in batch.batch] == [openai_completion(oai, prompt) for prompt in PROMPTS]
    chats = sdk.inference.batch_chat_completion(model_id=MODEL, messages_batch=CONVERSATIONS, sampling_params=GREEDY)
    assert [item.completion_message.content for item in chats.batch] == [openai_chat(oai, m) for m in CONVERSATIONS]
    # Meta-reference's field name on our own batch endpoint too.
    with server.http() as http:
        ours = http.post("/v1/batch/completions", json={"model": MODEL, "content_batch": PROMPTS, "temperature": 0,
                                                        "max_tokens": 12})
        assert ours.status_code == 200, ours.text
        assert [item["response"]["choices"][0]["text"] for item in ours.json()["data"]] == [
            item.content for item in batch.batch]


def test_sdk_models_list_parses(sdk):
    models = sdk.models.list()
    assert [m.identifier for m in models] == [MODEL]
    assert models[0].api_model_type == "llm" and models[0].type == "model" and models[0].provider_id


# --------------------------------------------------------------------------- multi-turn tool calls

@contextlib.contextmanager
def recorded_prompts(server, model_id: str):
    """Every EngineRequest the model's engine is given, while the block runs."""
    async def engine_of():
        async with server.registry.lease(model_id) as engine:
            return engine

    engine = server.call(engine_of())
    requests: list = []
    original = engine.generate

    def generate(request):
        requests.append(request)
        return original(request)

    engine.generate = generate
    try:
        yield requests
    finally:
        del engine.generate


def assert_tool_turns_render_alike(server, sdk, oai, model_id: str, call_end: str) -> None:
    native = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    openai = [dict(m) for m in native]
    call = {"call_id": "call_1", "tool_name": "get_weather", "arguments": {"city": "Paris"}}
    turns = [
        ([], []),
        ([{"role": "assistant", "content": "", "stop_reason": call_end, "tool_calls": [call]},
          {"role": "tool", "call_id": "call_1", "content": "18 C and sunny"}],
         [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]),
        ([{"role": "assistant", "content": "It is sunny.", "stop_reason": "end_of_turn"},
          {"role": "user", "content": "And tomorrow?"}],
         [{"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"}]),
    ]
    for native_more, openai_more in turns:
        native += native_more
        openai += openai_more
        with recorded_prompts(server, model_id) as requests:
            answer = sdk.inference.chat_completion(model_id=model_id, messages=native, tools=NATIVE_TOOLS,
                                                   sampling_params=GREEDY)
            reference = oai.chat.completions.create(model=model_id, messages=openai, tools=OPENAI_TOOLS,
                                                    temperature=0, max_tokens=12)
        native_request, openai_request = requests
        assert native_request.prompt_token_ids == openai_request.prompt_token_ids
        assert native_request.params == openai_request.params
        assert answer.completion_message.content == (reference.choices[0].message.content or "")
        calls = [(c.tool_name, c.arguments) for c in answer.completion_message.tool_calls or ()]
        assert calls == [(c.function.name, json.loads(c.function.arguments))
                         for c in reference.choices[0].message.tool_calls or ()]


def test_multi_turn_tool_calls_llama3_2(server, sdk, oai):
    assert_tool_turns_render_alike(server, sdk, oai, MODEL, "end_of_turn")


LLAMA4_DESCRIPTOR = "Llama-4-Scout-17B-16E-Instruct"


def tiny_llama4_checkpoint(checkpoints) -> Path:
    """<root>/Llama-4-Scout-17B-16E-Instruct: a tiny params.json in Llama 4's shape (MoE, NoPE interleave,
    chunked attention, qk-norm) and the real Llama 4 tokenizer. Until issue 15 the loader refuses it on
    params.json alone, so no weights are written; issue 15's tiny Llama 4 weights writer goes here."""
    from tests.engine.tokenizer_fixtures import llama_models_file

    out = checkpoints.root / LLAMA4_DESCRIPTOR
    if not out.exists():
        out.mkdir()
        params = {**E2E_PARAMS, "vocab_size": 202048, "use_qk_norm": True, "nope_layer_interval": 2,
                  "attention_chunk_size": 16, "moe_args": {"num_experts": 2, "top_k": 1, "interleave_moe_layer_step": 1}}
        (out / "params.json").write_text(json.dumps(params))
        shutil.copy(llama_models_file("llama4/tokenizer.model"), out / "tokenizer.model")
    return out


def test_multi_turn_tool_calls_llama4(server, sdk, oai, checkpoints):
    tiny_llama4_checkpoint(checkpoints)
    with server.http() as http:
        loaded = http.post("/v1/models", json={"model_id": LLAMA4_DESCRIPTOR})
        try:
            if loaded.status_code != 200 and "not supported" in loaded.text:
                pytest.skip(f"Llama 4 checkpoints do not load yet (issue 15): {loaded.json()['error']['message']}")
            assert loaded.status_code == 200, loaded.text
            assert_tool_turns_render_alike(server, sdk, oai, LLAMA4_DESCRIPTOR, "end_of_message")
        finally:
            http.delete(f"/v1/models/{LLAMA4_DESCRIPTOR}")
