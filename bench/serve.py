"""Load test any OpenAI-compatible server (ours, vLLM, llama.cpp's llama-server, ...), with the
flag names of `vllm bench serve`:

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --random-input-len 128 --random-output-len 64 --max-concurrency 8 [--request-rate inf]
    python bench/serve.py --backend openai-chat --dataset prompts.jsonl --num-prompts 100
    python bench/serve.py --sweep 1,4,16,32 --num-prompts 64 --result-filename sweep.json   # + sweep.png
    python bench/serve.py --backend responses-vs-chat --max-concurrency 32 --num-prompts 128   # /v1/responses against chat

Every request streams, so time to first token can be seen. Requests arrive as a Poisson process
at --request-rate per second (inf: all at once), at most --max-concurrency in flight. The output
length is held at --random-output-len with `ignore_eos` where the server accepts it (probed once;
a server that rejects it is told nothing and its lengths vary).

Prompts: --random-input-len random token ids. /v1/completions takes them as a token-id prompt where
the server accepts one (ours, vLLM, llama-server do); otherwise, and for chat, they become text
through the server's /detokenize, and the server's usage reports the lengths it actually saw.
--dataset reads a JSONL file of real prompts instead: {"prompt": "..."} or {"messages": [...]},
optionally with "max_tokens".

--backend openai-responses drives OpenAI's Responses API (/v1/responses: the chat prompts as `input`,
its stream events read for tokens and usage). It has no ignore_eos, so at temperature 0 its outputs
are the model's own length; responses-vs-chat runs the same prompts through /v1/responses and then
/v1/chat/completions, both without ignore_eos (greedy: the same tokens through both), twice each in
A B B A order, and prints the difference in output tokens/s and TTFT p50: the Responses layer's cost.

Reports (mean, p50, p90, p99):
- TTFT, time to first token: request sent -> first content token received.
- TPOT, time per output token: (E2E - TTFT) / (output tokens - 1), per request.
- ITL, inter-token latency: the gap between consecutive streamed chunks (a chunk can carry several
  tokens; vLLM counts the same way).
- E2E latency: request sent -> stream finished.
Plus request throughput, output and total (prompt + output) tokens/s over the whole run, and every
failed request with its status and error body. --sweep runs one benchmark per concurrency and
draws throughput and latency against concurrency (matplotlib, PNG beside the JSON file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Results  # noqa: E402

PERCENTILES = (50, 90, 99)
WORDS = "the of and to in is was for on that with as by at from his her an were are which this be or has had".split()


# --------------------------------------------------------------------------- records
@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class Prompt:
    body: dict[str, Any]  # "prompt" or "messages" (and max_tokens)
    expected_prompt_tokens: int  # 0 when unknown (text prompts: the server's usage tells)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    out = {"mean": statistics.fmean(values) if values else math.nan}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return out


# --------------------------------------------------------------------------- the server
class Server:
    """What this benchmark needs to know about the server, found out once before the run."""

    def __init__(self, session, base_url: str, api_key: str | None) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.session.post(self.base_url + path, json=body, headers=self.headers) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text

    async def only_model(self) -> str:
        async with self.session.get(self.base_url + "/v1/models", headers=self.headers) as response:
            if response.status != 200:
                raise SystemExit(f"GET /v1/models: HTTP {response.status}: {(await response.text())[:300]}; pass --model")
            models = [m["id"] for m in (await response.json()).get("data", [])]
        if len(models) != 1:
            raise SystemExit(f"the server has {len(models)} models ({', '.join(models) or 'none'}); pass --model")
        return models[0]

    async def accepts(self, path: str, body: dict[str, Any]) -> bool:
        status, _ = await self.post(path, {**body, "max_tokens": 1, "stream": False})
        return status == 200

    async def detokenize(self, model: str, token_ids: list[int]) -> str | None:
        status, data = await self.post("/detokenize", {"model": model, "tokens": token_ids})
        if status != 200 or not isinstance(data, dict):
            return None
        return data.get("prompt", data.get("content"))  # vLLM and ours: prompt; llama-server: content

    async def token_pool(self, model: str) -> list[int]:
        """Distinct ids of ordinary text in the server's own tokenizer (random prompts draw from
        them, so every id is valid and the text they spell re-tokenizes to about as many tokens);
        [] when the server has no /tokenize."""
        text = " ".join(WORDS) + " " + " ".join(f"{w.title()}, {i}." for i, w in enumerate(WORDS))
        for body in ({"model": model, "prompt": text, "add_special_tokens": False}, {"content": text}):  # ours/vLLM; llama-server
            status, data = await self.post("/tokenize", body)
            if status == 200 and isinstance(data, dict) and data.get("tokens"):
                return sorted(set(data["tokens"]))
        return []


# --------------------------------------------------------------------------- prompts
def read_dataset(path: Path, num_prompts: int, output_len: int, chat: bool) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(row, dict) or not ({"prompt", "messages"} & row.keys()):
            raise SystemExit(f'{path}:{number}: expected {{"prompt": ...}} or {{"messages": [...]}}')
        if chat:
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            body: dict[str, Any] = {"messages": messages}
        else:
            body = {"prompt": row["prompt"] if "prompt" in row else "\n".join(m["content"] for m in row["messages"])}
        body["max_tokens"] = int(row.get("max_tokens", output_len))
        prompts.append(Prompt(body, 0))
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]  # cycle when asked for more


async def random_prompts(server: Server, model: str, args: argparse.Namespace, chat: bool) -> list[Prompt]:
    """Token-id prompts where the endpoint takes them; else the text those ids spell (/detokenize);
    else random words (about one token each: the server's usage reports the true count)."""
    rng = random.Random(args.seed)
    pool = await server.token_pool(model)
    body = {"model": model, "max_tokens": args.random_output_len}
    if pool:
        ids = [[rng.choice(pool) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]
        if not chat and await server.accepts("/v1/completions", {"model": model, "prompt": ids[0][:4]}):
            return [Prompt({**body, "prompt": p}, len(p)) for p in ids]
        texts = [await server.detokenize(model, p) for p in ids]
    else:
        texts = [None]
    if None in texts:
        texts = [" ".join(rng.choice(WORDS) for _ in range(args.random_input_len)) for _ in range(args.num_prompts)]
    if chat:
        return [Prompt({**body, "messages": [{"role": "user", "content": t}]}, 0) for t in texts]
    return [Prompt({**body, "prompt": t}, 0) for t in texts]


# --------------------------------------------------------------------------- one request
async def send(server: Server, path: str, body: dict[str, Any]) -> RequestResult:
    """One streamed request; its timings, tokens and, on failure, the error body."""
    import aiohttp

    started = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, int] = {}
    try:
        async with server.session.post(server.base_url + path, json=body, headers=server.headers) as response:
            if response.status != 200:
                return RequestResult(False, error=f"HTTP {response.status}: {(await response.text())[:500]}")
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("type") == "error":
                    return RequestResult(False, error=f"in-band error: {json.dumps(chunk.get('error', chunk))[:500]}")
                if "type" in chunk:  # a Responses API event
                    if chunk["type"] in ("response.output_text.delta", "response.function_call_arguments.delta"):
                        stamps.append(time.perf_counter())
                    elif chunk["type"] in ("response.completed", "response.incomplete"):
                        got = chunk["response"]["usage"]
                        usage = {"prompt_tokens": got["input_tokens"], "completion_tokens": got["output_tokens"]}
                    continue
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if delta:
                    stamps.append(time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    ended = time.perf_counter()
    if not stamps:
        return RequestResult(False, error="the stream carried no tokens")
    return RequestResult(
        True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", len(stamps))),  # no usage: one token per chunk
        ttft_s=stamps[0] - started,
        e2e_s=ended - started,
        itl_s=[b - a for a, b in zip(stamps, stamps[1:])],
    )


# --------------------------------------------------------------------------- one benchmark
async def arrivals(num: int, rate: float, rng: random.Random):
    """Yield 0..num-1, spaced as a Poisson process of `rate` per second (inf: at once)."""
    for i in range(num):
        yield i
        if rate != math.inf and i < num - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(server: Server, path: str, prompts: list[Prompt], extra: dict[str, Any], *,
                        max_concurrency: int | None, request_rate: float, seed: int, progress: bool) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    bar = tqdm(total=len(prompts), desc=f"concurrency {max_concurrency or 'unbounded'}", unit="req", disable=not progress,
               file=sys.stderr)

    async def one(prompt: Prompt) -> RequestResult:
        async with limit:
            result = await send(server, path, {**prompt.body, **extra})
        if result.ok and not result.prompt_tokens:
            result.prompt_tokens = prompt.expected_prompt_tokens
        bar.update()
        return result

    started = time.perf_counter()
    tasks = []
    async for i in arrivals(len(prompts), request_rate, random.Random(seed)):
        tasks.append(asyncio.create_task(one(prompts[i])))
    results = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - started
    bar.close()
    return list(results), duration_s


def metrics(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "ttft_s": summary([r.ttft_s for r in done]),
        "tpot_s": summary([t for r in done if (t := r.tpot_s) is not None]),
        "itl_s": summary([gap for r in done for gap in r.itl_s]),
        "e2e_latency_s": summary([r.e2e_s for r in done]),
        "errors": [r.error for r in results if not r.ok],
    }


def print_report(label: str, m: dict[str, Any]) -> None:
    print(f"\n============ Serving Benchmark Result ({label}) ============")
    for name, value in (
        ("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"), ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]), ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
    ):  # fmt: skip
        print(f"{name:<40}{value:>12}")
    for key, title in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_latency_s", "E2E latency")):
        stats = m[key]
        print(f"{title + ' (ms)':<18}" + "  ".join(f"{k} {v * 1e3:9.2f}" for k, v in stats.items()))
    if m["errors"]:
        print(f"failed requests ({len(m['errors'])}); distinct errors:")
        for error, count in sorted({e: m["errors"].count(e) for e in m["errors"]}.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {count} x {error}")


def add_rows(out: Results, m: dict[str, Any], concurrency: int | None, rate: float) -> None:
    where = {"max_concurrency": concurrency, "request_rate": "inf" if rate == math.inf else rate}
    for name in ("request_throughput", "output_throughput", "total_token_throughput"):
        out.add(name, m[name], "req/s" if name == "request_throughput" else "tok/s", **where)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_latency_s"):
        for stat, value in m[key].items():
            out.add(f"{key.removesuffix('_s')} {stat}", value, "s", **where)
    out.add("failed", m["failed"], "requests", **where, errors=m["errors"][:20])


def plot_sweep(levels: list[int], sweep: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [m["output_throughput"] for m in sweep], marker="o", label="output tok/s")
    left.plot(levels, [m["total_token_throughput"] for m in sweep], marker="s", label="total tok/s")
    left.set(xlabel="max concurrency", ylabel="tokens/s", title="throughput", xscale="log")
    for key, label in (("ttft_s", "TTFT p50"), ("tpot_s", "TPOT p50"), ("e2e_latency_s", "E2E p50")):
        right.plot(levels, [m[key]["p50"] * 1e3 for m in sweep], marker="o", label=label)
    right.set(xlabel="max concurrency", ylabel="ms", title="latency", xscale="log", yscale="log")
    for axis in (left, right):
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # log axis: only the swept levels are labelled
        axis.set_xticks(levels, [str(n) for n in levels])
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------- main
async def main_async(args: argparse.Namespace) -> int:
    import aiohttp

    if args.backend == "responses-vs-chat":
        return await compare_responses_with_chat(args)
    responses = args.backend == "openai-responses"
    chat = args.backend == "openai-chat" or responses
    default_path = "/v1/responses" if responses else "/v1/chat/completions" if chat else "/v1/completions"
    path = args.endpoint or default_path
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        server = Server(session, args.base_url, args.api_key)
        model = args.model or await server.only_model()
        if args.dataset:
            prompts = read_dataset(Path(args.dataset), args.num_prompts, args.random_output_len, chat)
            for prompt in prompts:
                prompt.body["model"] = model
        else:
            prompts = await random_prompts(server, model, args, chat)
        if responses:
            prompts = [Prompt(as_responses_body(prompt.body), prompt.expected_prompt_tokens) for prompt in prompts]
        extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}, "temperature": args.temperature}
        if responses:  # usage comes with response.completed; the Responses API has no ignore_eos
            extra.pop("stream_options")
        elif not args.no_ignore_eos:
            if await server.accepts(path, {**prompts[0].body, "ignore_eos": True}):
                extra["ignore_eos"] = True
            else:
                print("the server refused ignore_eos: output lengths are the model's own", file=sys.stderr)
        if not responses and not await server.accepts(path, {**prompts[0].body, "stream_options": {"include_usage": True},
                                                             "stream": True}):
            extra.pop("stream_options")  # counts then come from the chunks
        levels = [int(n) for n in args.sweep.split(",")] if args.sweep else [args.max_concurrency]
        out = Results("serve", context={"base_url": server.base_url, "model": model, "endpoint": path})
        sweep = []
        for level in levels:
            results, duration_s = await run_benchmark(server, path, prompts, extra, max_concurrency=level,
                                                      request_rate=args.request_rate, seed=args.seed, progress=not args.disable_tqdm)
            m = metrics(results, duration_s)
            print_report(f"{model} at {server.base_url}{path}, max concurrency {level or 'unbounded'}", m)
            add_rows(out, m, level, args.request_rate)
            sweep.append(m)
    result_path = args.result_filename or ("serve_results.json" if args.save_result or args.sweep else None)
    out.write(result_path, ignore_eos=bool(extra.get("ignore_eos")), num_prompts=len(prompts))
    if args.sweep:
        plot_path = Path(result_path).with_suffix(".png")
        plot_sweep(levels, sweep, plot_path, f"{model}: {len(prompts)} prompts per concurrency")
    args.last_metrics = sweep
    return 1 if all(m["completed"] == 0 for m in sweep) else 0


def as_responses_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body as the Responses API asks the same: messages as `input`, max_output_tokens."""
    out = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
    out["input"] = body["messages"]
    out["max_output_tokens"] = body["max_tokens"]
    return out


async def compare_responses_with_chat(args: argparse.Namespace) -> int:
    """The same prompts through /v1/responses, then /v1/chat/completions, without ignore_eos; the
    Responses layer's cost in output tokens/s and TTFT p50 (positive: Responses is slower)."""
    results: dict[str, list[dict[str, Any]]] = {"openai-responses": [], "openai-chat": []}
    # One unmeasured run first: a fresh server's first batches pay one-time costs (allocations, kernel
    # builds, caches) that ABBA would charge to whichever API ran first. Then A B B A: drift over the
    # run (a neighbour's load) weighs on both alike.
    for index, backend in enumerate(("openai-chat", "openai-responses", "openai-chat", "openai-chat", "openai-responses")):
        run = argparse.Namespace(**{**vars(args), "backend": backend, "no_ignore_eos": True, "sweep": None,
                                    "result_filename": None, "save_result": False})
        if await main_async(run):
            return 1
        if index:
            results[backend].append(run.last_metrics[0])

    def mean(backend: str, read: Any) -> float:
        return statistics.fmean(read(m) for m in results[backend])

    tok_s = {b: mean(b, lambda m: m["output_throughput"]) for b in results}
    ttft_s = {b: mean(b, lambda m: m["ttft_s"]["p50"]) for b in results}
    slower = (tok_s["openai-chat"] - tok_s["openai-responses"]) / tok_s["openai-chat"] * 100
    later = (ttft_s["openai-responses"] - ttft_s["openai-chat"]) / ttft_s["openai-chat"] * 100
    print(f"responses vs chat at max concurrency {args.max_concurrency or 'unbounded'} (mean of 2 runs each, ABBA): "
          f"output tok/s {tok_s['openai-responses']:.1f} vs {tok_s['openai-chat']:.1f} ({slower:+.1f}% slower), "
          f"TTFT p50 {ttft_s['openai-responses'] * 1e3:.1f} vs {ttft_s['openai-chat'] * 1e3:.1f} ms ({later:+.1f}%)")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--backend", choices=("openai", "openai-chat", "openai-responses", "responses-vs-chat"),
                        default="openai", help="openai: /v1/completions; openai-chat: /v1/chat/completions; "
                        "openai-responses: /v1/responses; responses-vs-chat: both, the same prompts, compared")
    parser.add_argument("--endpoint", default=None, help="override the path the backend implies")
    parser.add_argument("--model", default=None, help="default: the server's only model")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--dataset", default=None, help='JSONL of real prompts: {"prompt": ...} or {"messages": [...]}, optional "max_tokens"')
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens per random prompt")
    parser.add_argument("--random-output-len", type=int, default=64, help="output tokens per request (max_tokens)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: let the model stop early")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: unbounded)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,4,16,32: one run each, plus a PNG")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--save-result", action="store_true", help="write serve_results.json")
    parser.add_argument("--result-filename", default=None, help="write the JSON here (the --sweep PNG goes beside it)")
    parser.add_argument("--disable-tqdm", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise SystemExit("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
