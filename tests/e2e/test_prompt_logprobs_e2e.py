"""Scoring text as eval harnesses do (lm-eval-harness loglikelihood): /v1/completions with
echo + logprobs and max_tokens 0 or 1, through the openai SDK against a live server on a tiny real
Llama 3 checkpoint (float64). A prompt token's logprob must equal the raw-model logprob of that
same token when it is generated after the tokens before it (forced by logit_bias, which logprobs
ignore), so the two independent paths of the engine check each other.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, ready_server

MODEL = BASE_DESCRIPTOR
PROMPT = "The capital of France is"
TOL = 1e-5  # logits travel as float32


@pytest.fixture(scope="module")
def server(base_checkpoint, checkpoints):
    with ready_server(MODEL, base_checkpoint, checkpoints.root, max_num_batched_tokens=4, max_prefill_chunk_tokens=0) as live:  # prompts are scored over several chunks
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.openai() as sdk:
        yield sdk


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    with server.http() as http:
        return http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]


def score(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, **kwargs)


def test_score_only_returns_the_prompt_and_its_logprobs(client, prompt_ids):
    completion = score(client, PROMPT)
    (choice,) = completion.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(prompt_ids) and completion.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == len(prompt_ids)
    assert logprobs.tokens[0] == "<|begin_of_text|>"
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
    # the best token, and the prompt's own when it is another (up to k+1 entries, as OpenAI)
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == value and len(top) == (1 if value == max(top.values()) else 2)
    assert "".join(logprobs.tokens[1:]) == PROMPT
    assert logprobs.text_offset == [0] + [len("".join(logprobs.tokens[1:i])) for i in range(1, len(prompt_ids))]


def test_prompt_logprobs_equal_forced_generation_logprobs(client, prompt_ids):
    scored = score(client, prompt_ids).choices[0].logprobs.token_logprobs
    for i in range(1, len(prompt_ids)):
        forced = client.completions.create(model=MODEL, prompt=prompt_ids[:i], max_tokens=1, temperature=0, logprobs=1,
                                           logit_bias={str(prompt_ids[i]): 100})
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(scored[i], abs=TOL), i


def test_echo_with_one_generated_token_as_lm_eval_sends_it(client, prompt_ids):
    prompt_only = score(client, PROMPT).choices[0].logprobs
    (choice,) = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                          temperature=0).choices
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(logprobs.tokens) == len(prompt_ids) + 1
    assert logprobs.token_logprobs[:-1] == pytest.approx(prompt_only.token_logprobs, abs=TOL)
    assert logprobs.text_offset[-1] == len(PROMPT)  # the generated token starts after the echo
    # what lm-eval sums for a continuation: the prompt tokens after the context, without the generated one
    assert sum(logprobs.token_logprobs[2:-1]) == pytest.approx(sum(prompt_only.token_logprobs[2:]), abs=TOL)


def test_streamed_equals_whole(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                                   temperature=0, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_batch_completions_score_each_prompt(server, client):
    prompts = [PROMPT, "Once upon a time"]
    with server.http() as http:
        body = http.post("/v1/batch/completions", json={"model": MODEL, "prompts": prompts, "echo": True,
                                                        "logprobs": 1, "max_tokens": 0}).json()
    for item, prompt in zip(body["data"], prompts):
        alone = score(client, prompt).choices[0].logprobs.token_logprobs
        (choice,) = item["response"]["choices"]
        assert choice["text"] == prompt
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone, abs=TOL)


def test_vllm_prompt_logprobs_field(client, prompt_ids):
    (choice,) = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 2}).choices
    scored = score(client, PROMPT).choices[0].logprobs.token_logprobs
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for i, entries in enumerate(prompt_logprobs[1:], start=1):
        assert entries[str(prompt_ids[i])]["logprob"] == pytest.approx(scored[i], abs=TOL)
        assert 2 <= len(entries) <= 3


def test_refused_without_echo_or_prompt_logprobs(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
