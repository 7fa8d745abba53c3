"""Llama 3.2 Vision served end to end: a tiny random checkpoint in Meta's release layout (one
consolidated.pth, the real Llama 3 tokenizer) behind the live server; the real openai SDK sends an
image as a base64 data URL, and the answer's tokens and logprobs equal llama-models' own generation
(its Llama 3 ChatFormat and CrossAttentionTransformer, full recompute, float32) for the same image
and text; a text-only chat on the same model equals the reference's text-only inference."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from tests.e2e.conftest import llama3_tokenizer_model, ready_server
from tests.engine.test_mllama import image
from tests.engine.tokenizer_fixtures import real_llama3
from tests.mllama_fixtures import reference_model, write_tiny_vision_checkpoint

pytest.importorskip("llama_models")
MODEL = "Llama3.2-11B-Vision-Instruct"
MAX_TOKENS = 6
STOP = {128001, 128008, 128009}  # <|end_of_text|>, <|eom_id|>, <|eot_id|>


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    out = checkpoints.root / "tiny-llama3.2-vision"
    if not out.exists():
        write_tiny_vision_checkpoint(out, vocab_size=128256, tokenizer_path=llama3_tokenizer_model())
    return out


@pytest.fixture(scope="module")
def server(checkpoint, checkpoints):
    with ready_server(MODEL, checkpoint, checkpoints.root, dtype="float32", cpu_kernels=False) as live:
        yield live


def png_bytes() -> bytes:
    out = io.BytesIO()
    image(50, 30, seed=3).save(out, format="PNG")
    return out.getvalue()


def reference_answer(checkpoint, content: list) -> tuple[list[int], list[float]]:
    """llama-models: ChatFormat.encode_dialog_prompt, then greedy generation by full recompute."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem
    from llama_models.llama3.chat_format import ChatFormat, create_vision_mask
    from llama_models.llama3.tokenizer import Tokenizer

    chat = ChatFormat(Tokenizer(llama3_tokenizer_model()))
    raw = [RawMediaItem(data=c) if isinstance(c, bytes) else RawTextItem(text=c) for c in content]
    prompt = chat.encode_dialog_prompt([RawMessage(role="user", content=raw)])
    tokens = list(prompt.tokens)
    images = prompt.vision.images if prompt.vision else []
    masks = create_vision_mask(tokens, 128256) if images else []
    total = len(tokens) + MAX_TOKENS
    out, logprobs = [], []
    with reference_model(checkpoint, max_seq_len=total) as model, torch.inference_mode():
        xattn, cross, rows = model.compute_vision_tokens_masks([images], [masks], total, torch.device("cpu"))
        for _ in range(MAX_TOKENS):
            padded = torch.tensor([tokens + [0] * (total - len(tokens))])
            logits = model.forward(torch.arange(len(tokens)), padded, cross, rows, xattn, text_only_inference=not images)[0, -1]
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
            if token in STOP:
                break
            tokens.append(token)
    return out, logprobs


def check(server, checkpoint, content: list, openai_content) -> None:
    expected, expected_logprobs = reference_answer(checkpoint, content)
    reply = server.openai().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
        messages=[{"role": "user", "content": openai_content}],
    )  # fmt: skip
    got = reply.choices[0].logprobs.content
    body = [t for t in expected if t not in STOP]
    assert body and len(got) == len(body)  # random weights: an answer of several tokens, not an immediate stop
    assert max((abs(g.logprob - e) for g, e in zip(got, expected_logprobs)), default=0.0) < 2e-3
    assert reply.choices[0].message.content == real_llama3().decode(body)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] in STOP else "length")


def test_openai_sdk_image_answer_equals_llama_models(server, checkpoint):
    data = png_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    check(server, checkpoint, ["What is this?", data],
          [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}])


def test_text_only_chat_equals_llama_models(server, checkpoint):
    check(server, checkpoint, ["Hello there"], [{"type": "text", "text": "Hello there"}])


def test_models_list_says_it_takes_images(server):
    models = server.http().get("/v1/models").json()["data"]
    (model,) = [m for m in models if m["id"] == MODEL]
    assert "image" in model["input_modalities"]


def test_llama_stack_native_route_image_answer_equals_llama_models(server, checkpoint):
    data = png_bytes()
    expected, _ = reference_answer(checkpoint, ["What is this?", data])
    content = [{"type": "text", "text": "What is this?"}, {"type": "image", "image": {"data": base64.b64encode(data).decode()}}]
    response = server.http().post("/v1/inference/chat-completion", json={
        "model_id": MODEL, "messages": [{"role": "user", "content": content}],
        "sampling_params": {"strategy": {"type": "greedy"}, "max_tokens": MAX_TOKENS}})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["completion_message"]["content"] == real_llama3().decode([t for t in expected if t not in STOP])
