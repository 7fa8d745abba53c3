"""Chat or completion: the two kinds of generation request, each described once (its OpenAI
decoders and routes, response id prefix, compat plan, assembler, object names) for every entry
point that serves them: the OpenAI routes (server/routes.py), the Llama Stack routes (which rewrite
their requests as these) and the Batch API (whose lines name a kind by its route).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgspec

from compat import protocol as p
from compat import to_engine
from compat.images import ImageRef, image_refs
from compat.from_engine import ChatAssembler, CompletionAssembler
from engine.types import ONLINE_PRIORITY, EngineClient, PreparedImage

Plan = to_engine.ChatPlan | to_engine.CompletionPlan
Assembler = ChatAssembler | CompletionAssembler


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class EndpointKind:
    """What differs between chat and completion; the request flow around it is one."""

    path: str  # the OpenAI route; a Batch API line's `url` names the kind by it
    batch_path: str  # this server's many-prompts-in-one-call route
    decoder: msgspec.json.Decoder  # the OpenAI request, decoded once at the edge
    batch_decoder: msgspec.json.Decoder
    id_prefix: str  # response ids: "<id_prefix>-<hex>"
    batch_object: str  # the batch response's `object`
    prompt: Callable[[Any], Any]  # request -> its prompt, as `plan` takes it (messages, or prompt)
    batch_prompts: Callable[[Any], tuple[list, str]]  # batch request -> (each prompt as `plan` takes it, their field)
    plan: Callable[..., Plan]  # (fields, prompt, engine, response id, *, priority) -> the engine requests
    assembler: Callable[..., Assembler]  # (fields, plan, engine, response id, *, include_usage) -> OpenAI objects
    # prompt -> its image parts (server/media.py prepares them; `prepare` takes the results as `images`)
    image_refs: Callable[[Any], list[ImageRef]] = lambda prompt: []

    def response_id(self) -> str:
        return new_response_id(self.id_prefix)

    def batch_item_id(self, batch_id: str, index: int) -> str:
        return f"{self.id_prefix}-{batch_id}-{index}"

    def prepare(
        self, fields: Any, prompt: Any, engine: EngineClient, response_id: str, *,
        priority: int = ONLINE_PRIORITY, include_usage: bool = False, images: Mapping[str, PreparedImage] | None = None,
    ) -> tuple[Plan, Assembler]:
        """The engine requests (at `priority`) and the assembler that turns their outputs into the response;
        `images`: the prompt's prepared images (server/media.py), by field."""
        extra = {"images": images} if images else {}  # only chat takes images
        plan = self.plan(fields, prompt, engine, response_id, priority=priority, **extra)
        return plan, self.assembler(fields, plan, engine, response_id, include_usage=include_usage)


def chat_assembler(req: Any, plan: to_engine.ChatPlan, engine: EngineClient, response_id: str, *,
                   include_usage: bool = False) -> ChatAssembler:
    """A chat request (single or batch item) and its plan -> its assembler."""
    return ChatAssembler(
        response_id=response_id, model=req.model, tokenizer=engine.tokenizer, chat_format=engine.chat_format,
        tools=plan.tools, n=req.n, num_prompt_tokens=len(plan.prompt_token_ids), want_logprobs=req.logprobs,
        include_usage=include_usage, forced_tools=plan.forced_tools, max_tool_calls=plan.max_tool_calls,
        generic_tools=plan.generic_tools, echo_text=plan.echo_text,
    )


def completion_assembler(req: Any, plan: to_engine.CompletionPlan, engine: EngineClient, response_id: str, *,
                         include_usage: bool = False) -> CompletionAssembler:
    """Likewise for completions; a batch item's plan holds one prompt."""
    return CompletionAssembler(
        response_id=response_id, model=req.model, tokenizer=engine.tokenizer,
        prompt_token_counts=[len(ids) for ids in plan.prompt_token_ids],
        echo_texts=plan.prompt_texts if req.echo else None, n=req.n, logprobs=req.logprobs,
        include_usage=include_usage, prompt_logprobs=req.prompt_logprobs, prompt_token_ids=plan.prompt_token_ids,
    )


def _completion_batch_prompts(req: p.BatchCompletionRequest) -> tuple[list, str]:
    prompts, param = to_engine.batch_prompts(req)
    # A token-id prompt is wrapped, so that `plan` reads it as one prompt (and an empty one is refused as such).
    return [prompt if isinstance(prompt, str) else [prompt] for prompt in prompts], param


CHAT = EndpointKind(
    path="/v1/chat/completions", batch_path="/v1/batch/chat/completions",
    decoder=p.CHAT_DECODER, batch_decoder=p.BATCH_CHAT_DECODER,
    id_prefix="chatcmpl", batch_object="batch.chat.completion",
    prompt=lambda req: req.messages, batch_prompts=lambda req: (req.messages_batch, "messages_batch"),
    plan=to_engine.chat_plan, assembler=chat_assembler, image_refs=image_refs,
)
COMPLETION = EndpointKind(
    path="/v1/completions", batch_path="/v1/batch/completions",
    decoder=p.COMPLETION_DECODER, batch_decoder=p.BATCH_COMPLETION_DECODER,
    id_prefix="cmpl", batch_object="batch.text_completion",
    prompt=lambda req: req.prompt, batch_prompts=_completion_batch_prompts,
    plan=to_engine.completion_plan, assembler=completion_assembler,
)
KINDS: tuple[EndpointKind, ...] = (CHAT, COMPLETION)
KIND_BY_PATH: dict[str, EndpointKind] = {kind.path: kind for kind in KINDS}
