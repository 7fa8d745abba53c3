"""Speculative decoding end to end (issue 35): models registered over HTTP with a speculative_config
(prompt lookup, and a draft model that is another registered model), served to the OpenAI SDK with
greedy output identical to an engine without speculation, and the spec_decode metrics counted.
Tiny real Llama 3 checkpoints (random weights, the real tokenizer), float64."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import BASE_DESCRIPTOR, empty_server, expected_greedy_texts, metric, scrape

PHRASE = [40, 1093, 279, 11277, 315, 9822, 13, 578, 6460, 374]  # a phrase of ordinary text tokens
PROMPT_IDS = [128000] + PHRASE * 3 + PHRASE[:3]  # <|begin_of_text|> then the phrase, quoted three times
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(checkpoints):
    with empty_server(checkpoints.root) as live:
        yield live


def test_ngram_and_draft_model_over_http(server, checkpoints):
    base = checkpoints.get(BASE_DESCRIPTOR, seed=0)
    checkpoints.get("spec-draft", seed=7)  # same tokenizer, other weights
    expected = expected_greedy_texts(base, [PROMPT_IDS], MAX_TOKENS)[0]
    with server.http() as http:
        ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        for body in (
            {"model_id": "lookup", "checkpoint_dir": BASE_DESCRIPTOR, "llama_model": BASE_DESCRIPTOR,
             "metadata": {"speculative_config": ngram}},
            {"model_id": "base", "checkpoint_dir": BASE_DESCRIPTOR, "llama_model": BASE_DESCRIPTOR},
            {"model_id": "draft", "checkpoint_dir": "spec-draft", "llama_model": BASE_DESCRIPTOR, "skip_initialize": True},
            {"model_id": "drafted", "checkpoint_dir": BASE_DESCRIPTOR, "llama_model": BASE_DESCRIPTOR,
             "speculative_config": {"model": "draft", "num_speculative_tokens": 3}},
        ):
            response = http.post("/v1/models", json=body)
            assert response.status_code == 200, response.text
        bad = http.post("/v1/models", json={"model_id": "x", "checkpoint_dir": BASE_DESCRIPTOR, "llama_model": BASE_DESCRIPTOR,
                                            "speculative_config": {"model": "nope", "num_speculative_tokens": 3}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative_config.model"
        client = server.openai()
        for model in ("base", "lookup", "drafted"):
            reply = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0)
            assert reply.choices[0].text == expected, model
            assert reply.usage.completion_tokens == MAX_TOKENS
        samples = scrape(http)
        # both engines speculate (the families exist only for those); a random model over a 128k vocabulary
        # never repeats itself in a few tokens, so prompt lookup finds nothing to propose after the prompt
        # (tests/engine/test_speculative.py has prompts it accepts and rejects), while the draft model always
        # proposes
        for model in ("lookup", "drafted"):
            drafted = metric(samples, "vllm:spec_decode_num_draft_tokens_total", model_name=model)
            accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total", model_name=model)
            assert drafted is not None and accepted is not None and accepted <= drafted, (model, drafted, accepted)
            assert metric(samples, "llamaserve:spec_decode_draft_tokens_total", model_name=model) == drafted
            assert metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=model, position="0") is not None
        assert metric(samples, "vllm:spec_decode_num_draft_tokens_total", model_name="drafted") > 0
        assert metric(samples, "vllm:spec_decode_num_drafts_total", model_name="base") is None  # not speculating
