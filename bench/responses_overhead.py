"""What the Responses and Anthropic layers add per streamed token, measured alone: chat's
ChatAssembler.chunk + SSE frame, against the same plus ResponseBuilder.chunk (or MessageBuilder.chunk)
and its named event, over one-token deltas of a FakeEngine's tokenizer. No server, no model: the
per-token CPU each API layer costs the event loop.

    python bench/responses_overhead.py [--tokens 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compat import anthropic as a  # noqa: E402
from compat import responses as r  # noqa: E402
from compat.from_engine import ChatAssembler  # noqa: E402
from engine.types import RequestOutput  # noqa: E402
from server.sse import Event, frame  # noqa: E402
from tests.server.fake_engine import FakeEngine  # noqa: E402


def outputs(num_tokens: int) -> list[RequestOutput]:
    return [RequestOutput(request_id="x", new_token_ids=[65], text_delta="A", num_prompt_tokens=10,
                          num_output_tokens=i + 1) for i in range(num_tokens)]


def assembler(engine: FakeEngine) -> ChatAssembler:
    return ChatAssembler(response_id="c", model="m", tokenizer=engine.tokenizer, chat_format=engine.chat_format,
                         tools=(), n=1, num_prompt_tokens=10, want_logprobs=False, include_usage=True)


def per_token_us(kind: str, outs: list[RequestOutput], engine: FakeEngine) -> float:
    chat = assembler(engine)
    responses = r.ResponseBuilder(r.response_shell(r.RESPONSES_DECODER.decode(b'{"model": "m", "input": "x"}'), "resp",
                                                   status="in_progress"))
    messages = a.MessageBuilder(message_id="msg", model="m", num_input_tokens=10)
    started = time.perf_counter()
    for out in outs:
        chunk = chat.chunk(0, out)
        if kind == "chat":
            frame(chunk)
        elif kind == "responses":
            frame([Event(e["type"] if isinstance(e, dict) else e.type, e) for e in responses.chunk(chunk)])
        else:
            frame([Event(name, data) for name, data in messages.chunk(chunk)])
    return (time.perf_counter() - started) / len(outs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = FakeEngine()
    outs = outputs(args.tokens)
    for kind in ("chat", "responses", "messages"):
        best = min(per_token_us(kind, outs, engine) for _ in range(args.rounds))
        print(f"{kind:<10} {best:6.2f} us per streamed token (best of {args.rounds}, {args.tokens} tokens)")


if __name__ == "__main__":
    main()
