"""Issue 14 (parameter policy, generation defaults, eval endpoints) end to end: the openai SDK,
lm-eval's `local-completions` with its remote tokenizer, and litellm against a live server on a
tiny Llama 3 checkpoint (random weights, the real tokenizer) that carries a generation_config.json.

One server per module; requests are greedy or seeded and the engine runs in float64, so every
expectation is exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import openai
import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, ready_server

MODEL = BASE_DESCRIPTOR
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "bos_token_id": 128000}
IN_FORCE = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def server(base_checkpoint, checkpoints):
    """The base checkpoint (hard-linked, not copied) plus a generation_config.json."""
    directory = checkpoints.root / "with-generation-config" / MODEL
    if not directory.exists():
        shutil.copytree(base_checkpoint, directory, copy_function=os.link)
        (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with ready_server(MODEL, directory, checkpoints.root) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.openai() as sdk:
        yield sdk


@pytest.fixture(scope="module")
def http(server):
    with server.http() as session:
        yield session


def chat_text(client, **kwargs) -> str:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs).choices[0].message.content


# --------------------------------------------------------------------------- generation defaults
def test_models_show_the_checkpoints_sampling_defaults(client, http):
    assert http.get(f"/v1/models/{MODEL}").json()["sampling_defaults"] == IN_FORCE


def test_requests_without_sampling_fields_get_the_checkpoints_defaults(client):
    explicit = dict(temperature=0.7, top_p=0.9, extra_body={"top_k": 50})
    openais = dict(temperature=1.0, top_p=1.0, extra_body={"top_k": -1})
    differs = 0
    for seed in (1, 2, 3):
        omitted = chat_text(client, seed=seed)
        assert omitted == chat_text(client, seed=seed, **explicit)
        assert omitted == chat_text(client, seed=seed, temperature=None, top_p=None)  # null: the default
        differs += omitted != chat_text(client, seed=seed, **openais)
    assert differs  # the defaults in force are not OpenAI's


# --------------------------------------------------------------------------- the three classes
def test_fields_accepted_without_effect_change_nothing(client):
    plain = chat_text(client, seed=5)
    assert chat_text(client, seed=5, store=True, metadata={"team": "evals"}, service_tier="auto", user="u-1",
                     safety_identifier="h-1", prompt_cache_key="k", prompt_cache_retention="24h",
                     extra_body={"prompt_cache_options": {"mode": "implicit"}}) == plain
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=5, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("param,kwargs", [
    ("reasoning_effort", {"reasoning_effort": "high"}),
    ("modalities", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "Blue."}}),
    ("web_search_options", {"web_search_options": {}}),
    ("verbosity", {"verbosity": "low"}),
])
def test_fields_we_cannot_honour_are_refused_by_name(client, param, kwargs):
    with pytest.raises(openai.BadRequestError) as info:
        chat_text(client, **kwargs)
    assert info.value.body["param"] == param and info.value.body["code"] == "unsupported_parameter"


def test_unknown_names_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat_text(client, extra_body={"frobnicate": True})
    assert info.value.body["param"] == "frobnicate"


def test_completion_logprobs_include_the_sampled_token(client):
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, logprobs=2, seed=7,
                                           temperature=1.0)
    logprobs = completion.choices[0].logprobs
    outside_top = 0
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == value and len(top) <= 3
        outside_top += len(top) == 3
    assert outside_top  # at temperature 1 random weights often sample outside the top 2: k+1 entries then


# --------------------------------------------------------------------------- prompts
def test_completions_text_prompts_parse_special_tokens(client, http):
    templated = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = http.post("/tokenize", json={"prompt": templated, "add_special_tokens": False}).json()["tokens"]
    assert ids[:2] == [128000, 128006] and ids[-1] == 128009 and len(ids) == 7
    by_text = client.completions.create(model=MODEL, prompt=templated, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.usage.prompt_tokens == 7  # one BOS: the prompt brought its own
    assert by_text.choices[0].text == by_ids.choices[0].text


def test_text_parts_are_concatenated_as_they_are(http):
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": " colour."}]
    as_parts = http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    assert as_parts == http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]


# --------------------------------------------------------------------------- eval harness: lm-eval
def test_tokenizer_info_in_vllms_shape(http):
    info = http.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (128000, 128001, None)


DOCS = [
    {"question": "What colour is the sky?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "2 + 2 =", "choices": ["4", "5"], "answer": 0},
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin", "Madrid"], "answer": 0},
]


def echo_score(http, context: str, continuation: str) -> tuple[float, bool]:
    """The server's own score of `continuation` after `context`: its echoed prompt logprobs."""
    def ids(text: str) -> list[int]:
        return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    context_ids, continuation_ids = ids(context), ids(continuation)
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": context_ids + continuation_ids, "echo": True,
                                               "logprobs": 1, "max_tokens": 0}).json()
    logprobs = body["choices"][0]["logprobs"]
    values = logprobs["token_logprobs"][len(context_ids):]
    tops = logprobs["top_logprobs"][len(context_ids):]
    return sum(values), all(value == max(top.values()) for value, top in zip(values, tops))


def run_client(script: str, *args: str) -> Any:
    """Run a client library in a child process (their imports and threads stay out of the test
    process, whose memory other e2e tests measure); it prints its findings as JSON, last line."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",  # local files only
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no fetch of litellm's price list
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
url, model, task_dir = sys.argv[1:]
results = lm_eval.simple_evaluate(
    model="local-completions", model_args=f"base_url={url}/v1/completions,model={model},tokenizer_backend=remote",
    tasks=["llamaserve_tiny_mc"], task_manager=TaskManager(include_path=task_dir), log_samples=True,
)
samples = results["samples"]["llamaserve_tiny_mc"]
scored = [[*args, *resp] for s in samples for args, resp in zip(s["arguments"], s["filtered_resps"])]
print(json.dumps({"scored": scored, "acc": results["results"]["llamaserve_tiny_mc"]["acc,none"]}))
"""


def test_lm_eval_local_completions_with_the_remote_tokenizer(server, http, tmp_path):
    pytest.importorskip("lm_eval")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: llamaserve_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    found = run_client(LM_EVAL, server.url, MODEL, str(tmp_path))
    assert len(found["scored"]) == sum(len(doc["choices"]) for doc in DOCS)
    for context, continuation, loglikelihood, is_greedy in found["scored"]:
        assert (loglikelihood, is_greedy) == pytest.approx(echo_score(http, context, continuation), abs=1e-9)
    assert 0.0 <= found["acc"] <= 1.0


# --------------------------------------------------------------------------- litellm
LITELLM = """
import json, sys
import litellm
url, model, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kwargs = dict(model=f"openai/{model}", api_base=url + "/v1", api_key="none", messages=messages, max_tokens=8,
              temperature=0)
plain = litellm.completion(**kwargs)
chunks = list(litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True}))
print(json.dumps({
    "plain": plain.choices[0].message.content, "plain_tokens": plain.usage.completion_tokens,
    "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
    "streamed_tokens": chunks[-1].usage.completion_tokens,
}))
"""


def test_litellm_completion_plain_and_streamed(server, client):
    pytest.importorskip("litellm")
    found = run_client(LITELLM, server.url, MODEL, json.dumps(MESSAGES))
    expected = chat_text(client, temperature=0)
    assert found == {"plain": expected, "plain_tokens": 8, "streamed": expected, "streamed_tokens": 8}
