"""Our EngineCore against OpenVINO GenAI's continuous-batching pipeline, both in-process (no HTTP:
OpenVINO GenAI has no server here), same weights, same workload (a script, not a test; issue 35).

    bench/openvino_setup.sh                      # once: venv /tmp/ovgenai, IR of the demo in /tmp/smollm2-ov (minutes)
    python bench/openvino_inprocess.py [--dtype float32|bfloat16] [--streams 1,8,32] [--rounds 2]
        [--ov-model /tmp/smollm2-ov/fp32] [--ov-python /tmp/ovgenai/bin/python] [--engines llamaserve,openvino]
        [--model-gguf BIG1B.gguf --ov-model /tmp/big1b-ov/fp32]   # the 1.1B random Llama (BIG=1 bench/openvino_setup.sh)
        [--checkpoint-dir DIR] [--smoke] [--json PATH]

Workload (bench/demo_vs_llamacpp.py's, without the HTTP): at each N, N sequences of --prompt-tokens
random token ids (fresh every round and every N, the same for both engines within a round) submitted
at once, --output-tokens tokens each, greedy, end of sequence ignored (OpenVINO: ignore_eos, not
min_new_tokens, which masks the end-of-sequence token instead); both engines take the prompts as
token ids. Reported per engine and N: output tok/s, TPOT p50 (per sequence, first to last token over
tokens - 1) and TTFT p50 (submission to first token), beside the roofline of the moment
(bench/demo_vs_llamacpp.py's, measured by this process right before each engine's round; the bf16
matmul rate only for a bfloat16 run), and the ratio ours / OpenVINO within each round.

Each engine runs in a worker process of its own, one at a time, alternating for --rounds rounds:
ours with this python (EngineCore driven step by step, as bench/streams_inprocess.py does), OpenVINO
with the OpenVINO venv's python (ContinuousBatchingPipeline driven step by step: add_request, step,
read), so neither's libraries (torch and OpenMP, OpenVINO and TBB) load into the other's process.
Both run on 2 threads (--threads) in --dtype: OpenVINO with INFERENCE_PRECISION_HINT and its KV cache
in that precision too (its CPU default KV cache is u8; --ov-kv-precision u8 measures that), ours at
its defaults (512-token step budget) but for max_batch_size (max N); OpenVINO at its SchedulerConfig
defaults but for cache_size, max_num_seqs (max N) and prefix caching (off, as fresh prompts never hit).

Before the rounds, both engines answer the same chat prompts (rendered by our chat template) alone,
greedily, in float32; the script prints how many of the first tokens agree and "greedy tokens match:
yes|no" (--no-check skips it). On the exported fp32 IR both hold identical weights; the int8 IR does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# stdlib only at import time: the OpenVINO venv's python runs this file too, without our packages
from bench.common import Results, add_results_arguments  # noqa: E402
from bench.demo_vs_llamacpp import EXACT_QUESTIONS, Moment, Run, compare, figures, level_prompts, markdown, report  # noqa: E402

ENGINES = ("llamaserve", "openvino")
DEFAULT_OV_PYTHON = Path("/tmp/ovgenai/bin/python")  # bench/openvino_setup.sh's VENV
DEFAULT_OV_MODEL = Path("/tmp/smollm2-ov/fp32")  # bench/openvino_setup.sh's OV_DIR / fp32
OV_PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> OpenVINO's element type names
OV_CACHE_GB = 2  # its KV cache, as our CPU default (EngineConfig.cpu_kv_cache_bytes)
MAX_SEQ_LEN = 1024
CHECK_TOKENS = 16  # greedy tokens compared per prompt: the first few, past the first answer's end-of-sequence token (ignored)
WORKER_TIMEOUT_S = 3600


# --------------------------------------------------------------------------- the workers
def sequence_times(submitted_s: float, stamps: list[float], output_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one sequence from the times its tokens appeared (one stamp per step that
    gave it tokens; a step may give several)."""
    return stamps[0] - submitted_s, (stamps[-1] - stamps[0]) / max(output_tokens - 1, 1)


def level_result(submitted_s: float, stamps: dict[Any, list[float]], counts: dict[Any, int], num_sequences: int,
                 output_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One level's figures; every sequence must have given exactly output_tokens (end of sequence ignored)."""
    ends = [s[-1] for s in stamps.values()]
    if len(counts) != num_sequences or any(n != output_tokens for n in counts.values()):
        raise RuntimeError(f"expected {num_sequences} sequences of {output_tokens} tokens, got {len(counts)} of {sorted(set(counts.values()))}")
    times = [sequence_times(submitted_s, s, output_tokens) for s in stamps.values()]
    return {"wall_s": max(ends) - submitted_s, "output_tokens": sum(counts.values()),
            "ttft_s": [t[0] for t in times], "tpot_s": [t[1] for t in times]}  # fmt: skip


def ours_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Our EngineCore on this python: load, warm up, run the job's levels (or the greedy check)."""
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # as the server sets it (server/__main__.py), before torch loads
    import torch

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup
    from engine.loader import load_tokenizer_and_chat_format
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.types import ChatMessage, EngineRequest, SamplingParams

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    spec = resolve_checkpoint(Path(job["checkpoint_dir"]), model_id="bench", llama_model=job.get("llama_model"))
    tokenizer, chat_format = load_tokenizer_and_chat_format(spec, None)
    config = EngineConfig(dtype=job["dtype"], max_batch_size=max(32, *job["levels"]))
    core = EngineCore(ModelExecutor(WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN), seed=config.seed), tokenizer, config, MAX_SEQ_LEN)
    load_s = time.perf_counter() - started

    def run(prompts: list[list[int]], output_tokens: int, tag: str) -> tuple[dict[str, Any], dict[str, list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        stamps: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}
        submitted = time.perf_counter()
        for i, prompt in enumerate(prompts):
            core.add_request(EngineRequest(f"{tag}{i}", prompt, params))
        while core.has_unfinished:
            outputs = core.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids:
                    stamps.setdefault(out.request_id, []).append(now)
                    counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return level_result(submitted, stamps, counts, len(prompts), output_tokens), tokens

    try:
        if job["mode"] == "check":
            prompts = [chat_format.encode_dialog([ChatMessage("user", q)]) for q in job["questions"]]
            answers = [run([p], job["output_tokens"], f"check{i}-")[1][f"check{i}-0"] for i, p in enumerate(prompts)]
            return {"prompts": prompts, "tokens": answers, "load_s": load_s}
        run([list(range(200, 216))], 4, "warm")
        levels = {}
        for n in job["levels"]:
            levels[n] = run(level_prompts(n, job["prompt_tokens"], job["round"]), job["output_tokens"], f"n{n}-")[0]
        return {"levels": levels, "load_s": load_s, "engine": f"llamaserve EngineCore, torch {torch.__version__}, "
                f"max_batch_size {config.max_batch_size}, step budget {config.max_num_batched_tokens} tokens"}  # fmt: skip
    finally:
        core.runner.shutdown()


def openvino_worker(job: dict[str, Any]) -> dict[str, Any]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the OpenVINO venv's python, driven step by step."""
    import importlib.metadata

    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if job["dtype"] == "bfloat16" and "BF16" not in capabilities:
        # its CPU plugin then computes in f32 whatever the hint says, and refuses a bf16 KV cache
        raise SystemExit(f"OpenVINO has no bf16 path on this CPU (capabilities {capabilities}): compare in float32 here")
    started = time.perf_counter()
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = OV_CACHE_GB
    scheduler.max_num_seqs = max(scheduler.max_num_seqs, *job["levels"])
    scheduler.enable_prefix_caching = False
    precision = OV_PRECISIONS[job["dtype"]]
    properties = {"INFERENCE_NUM_THREADS": job["threads"], "INFERENCE_PRECISION_HINT": precision,
                  "KV_CACHE_PRECISION": job.get("ov_kv_precision") or precision}  # fmt: skip
    pipe = ov_genai.ContinuousBatchingPipeline(job["ov_model"], scheduler, "CPU", properties)
    load_s = time.perf_counter() - started
    next_id = iter(range(1 << 62))

    def run(prompts: list[list[int]], output_tokens: int) -> tuple[dict[str, Any], dict[int, list[int]]]:
        config = ov_genai.GenerationConfig()
        # ignore_eos alone, as ours: min_new_tokens would also mask the end-of-sequence token's logit,
        # so greedy would pick another token where ours picks it and goes on
        config.max_new_tokens = output_tokens
        config.ignore_eos = True
        config.do_sample = False
        stamps: dict[int, list[float]] = {}
        counts: dict[int, int] = {}
        tokens: dict[int, list[int]] = {}
        submitted = time.perf_counter()
        handles = {}
        for prompt in prompts:
            request_id = next(next_id)
            handles[request_id] = pipe.add_request(request_id, ov.Tensor(np.array([prompt], dtype=np.int64)), config)
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter()
            for request_id, handle in handles.items():
                if handle.can_read():
                    for out in handle.read().values():  # one sequence per request (greedy): its tokens since the last read
                        if out.generated_ids:
                            stamps.setdefault(request_id, []).append(now)
                            counts[request_id] = counts.get(request_id, 0) + len(out.generated_ids)
                            tokens.setdefault(request_id, []).extend(out.generated_ids)
        return level_result(submitted, stamps, counts, len(prompts), output_tokens), {i: tokens[r] for i, r in enumerate(handles)}

    if job["mode"] == "check":
        return {"tokens": [run([p], job["output_tokens"])[1][0] for p in job["prompts"]], "load_s": load_s}
    run([list(range(200, 216))], 4)
    levels = {n: run(level_prompts(n, job["prompt_tokens"], job["round"]), job["output_tokens"])[0] for n in job["levels"]}
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("openvino-genai", "openvino"))
    return {"levels": levels, "load_s": load_s,
            "engine": f"{versions}, ContinuousBatchingPipeline, {properties}, max_num_seqs {scheduler.max_num_seqs}, "
                      f"max_num_batched_tokens {scheduler.max_num_batched_tokens}, dynamic_split_fuse {scheduler.dynamic_split_fuse}"}  # fmt: skip


WORKERS = {"llamaserve": ours_worker, "openvino": openvino_worker}


def worker_main(engine: str, job_path: Path, out_path: Path) -> None:
    out_path.write_text(json.dumps(WORKERS[engine](json.loads(job_path.read_text()))))


# --------------------------------------------------------------------------- the parent
class WorkerFailed(RuntimeError):
    """A worker process exited with an error (its output's tail is printed already)."""


def run_worker(python: str, engine: str, job: dict[str, Any], *, verbose: bool) -> dict[str, Any]:
    """Run one worker process to the end: its result (a JSON file), or WorkerFailed after its output's tail."""
    with tempfile.TemporaryDirectory(prefix=f"ov-bench-{engine}-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        command = [python, str(Path(__file__).resolve()), "--worker", engine, str(job_path), str(out_path)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
        if verbose or done.returncode != 0:
            sys.stdout.write(done.stdout[-4000:] + done.stderr[-4000:])
        if done.returncode != 0 or not out_path.is_file():
            raise WorkerFailed(f"{engine} worker ({python}) exited {done.returncode}")
        return json.loads(out_path.read_text())


def as_runs(result: dict[str, Any], moment: Moment) -> dict[int, Run]:
    return {int(n): Run(int(n), r["wall_s"], r["output_tokens"], r["ttft_s"], r["tpot_s"], moment) for n, r in result["levels"].items()}


def greedy_check(pythons: dict[str, str], base_job: dict[str, Any], num_tokens: int) -> bool:
    """The same chat prompts alone, greedy, float32, through both engines: do their first tokens agree?"""
    job = {**base_job, "mode": "check", "dtype": "float32", "questions": EXACT_QUESTIONS, "output_tokens": num_tokens}
    ours = run_worker(pythons["llamaserve"], "llamaserve", job, verbose=False)
    theirs = run_worker(pythons["openvino"], "openvino", {**job, "prompts": ours["prompts"]}, verbose=False)
    print(f"greedy check, float32, first {num_tokens} tokens of each answer (prompts rendered by our chat template):")
    agree = []
    for question, mine, other in zip(EXACT_QUESTIONS, ours["tokens"], theirs["tokens"]):
        same = next((k for k, (a, b) in enumerate(zip(mine, other)) if a != b), min(len(mine), len(other)))
        agree.append(same == num_tokens == len(mine) == len(other))
        print(f"  {question!r}: {same}/{num_tokens} identical" + ("" if agree[-1] else f" (ours {mine}, OpenVINO {other})"))
    print(f"greedy tokens match: {'yes' if all(agree) else 'no'}", flush=True)
    return all(agree)


def our_checkpoint(args: argparse.Namespace) -> tuple[Path, str | None]:
    """(checkpoint dir, llama_model) of the weights OpenVINO's IR was exported from."""
    from bench.demo_vs_llamacpp import other_model
    from engine.loading.demo import default_cache_dir, ensure_demo_checkpoint

    if args.checkpoint_dir:
        return Path(args.checkpoint_dir), args.llama_model
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.model_gguf:  # imported once into the cache at --dtype, as the three-way bench does
        return other_model(Path(args.model_gguf), None, cache_dir, args.dtype).checkpoint_dir, None
    return ensure_demo_checkpoint(cache_dir).checkpoint_dir, None


def main_parent(args: argparse.Namespace) -> int:
    from bench.demo_vs_llamacpp import measure_moment, model_counts

    engines = [e.strip() for e in args.engines.split(",")]
    if unknown := [e for e in engines if e not in ENGINES]:
        print(f"unknown engines {unknown}: choose from {', '.join(ENGINES)}")
        return 1
    pythons = {"llamaserve": sys.executable, "openvino": str(args.ov_python)}
    if "openvino" in engines and not (Path(args.ov_python).is_file() and (Path(args.ov_model) / "openvino_model.xml").is_file()):
        print(f"OpenVINO GenAI not set up: no {args.ov_python} or no {Path(args.ov_model) / 'openvino_model.xml'}; "
              "run bench/openvino_setup.sh (or leave openvino out of --engines)")  # fmt: skip
        return 1
    levels = [int(n) for n in args.streams.split(",")]
    checkpoint_dir, llama_model = our_checkpoint(args)
    counts = model_counts(checkpoint_dir, llama_model)
    base_job = {"checkpoint_dir": str(checkpoint_dir), "llama_model": llama_model, "ov_model": str(args.ov_model),
                "ov_kv_precision": args.ov_kv_precision, "threads": args.threads, "dtype": args.dtype, "levels": levels,
                "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}  # fmt: skip
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; engines {', '.join(engines)}; {args.dtype}; "
          f"{args.threads} threads; ours {checkpoint_dir}, OpenVINO {args.ov_model}", flush=True)  # fmt: skip
    matched = None
    if not args.no_check and len(engines) == 2:
        matched = greedy_check(pythons, base_job, args.check_tokens)
    results: dict[str, list[dict[int, Run]]] = {e: [] for e in engines}
    described: dict[str, str] = {}
    for round_index in range(args.rounds):
        for engine in engines:  # one at a time
            moment = measure_moment(smoke=args.smoke, dtype=args.dtype)
            result = run_worker(pythons[engine], engine, {**base_job, "mode": "levels", "round": round_index}, verbose=args.verbose)
            described[engine] = result["engine"]
            results[engine].append(as_runs(result, moment))
            one = results[engine][-1]
            print(f"round {round_index} {engine} (loaded in {result['load_s']:.1f} s): "
                  + ", ".join(f"{n}: {r.output_tokens_per_s:.1f} tok/s" for n, r in one.items()), flush=True)  # fmt: skip
    for engine in engines:
        print(f"{engine}: {described[engine]}")
        report(engine, results[engine], counts, args.dtype, args.prompt_tokens, args.output_tokens)
    if len(engines) == 2:
        compare(results["llamaserve"], results["openvino"], "openvino")
    print("\n" + markdown(results, args.dtype, args))
    if matched is not None:
        print(f"greedy tokens match (float32): {'yes' if matched else 'no'}")
    write_json(args, results, matched, described)
    return 0


def write_json(args: argparse.Namespace, results: dict[str, list[dict[int, Run]]], matched: bool | None, described: dict[str, str]) -> None:
    out = Results("openvino_inprocess", context={"dtype": args.dtype})
    for engine, rounds in results.items():
        for n in rounds[0]:
            f = figures(rounds, n)
            out.add("output throughput", f["tok_s"], "tok/s", engine=engine, concurrency=n)
            out.add("TPOT p50", f["tpot_s"] * 1e3, "ms", engine=engine, concurrency=n)
            out.add("TTFT p50", f["ttft_s"], "s", engine=engine, concurrency=n)
    if matched is not None:
        out.add("greedy tokens match", float(matched), "bool", check_tokens=args.check_tokens)
    out.write(args.json, threads=args.threads, engines=described)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":  # a worker process (either python)
        worker_main(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    parser.add_argument("--dtype", choices=list(OV_PRECISIONS), default="float32", help="both engines' compute precision")
    parser.add_argument("--streams", default="1,8,32", help="concurrent sequences, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="times each engine is loaded and measured, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ov-python", default=str(DEFAULT_OV_PYTHON), help="the OpenVINO venv's python (bench/openvino_setup.sh)")
    parser.add_argument("--ov-model", default=str(DEFAULT_OV_MODEL), help="the exported OpenVINO IR folder (optimum-cli export openvino)")
    parser.add_argument("--ov-kv-precision", default=None, help="OpenVINO's KV cache precision (default: --dtype's; its own CPU default is u8)")
    parser.add_argument("--model-gguf", default=None, help="ours: this GGUF imported at --dtype instead of the demo (e.g. BIG1B.gguf)")
    parser.add_argument("--checkpoint-dir", default=None, help="ours: this checkpoint instead of the demo")
    parser.add_argument("--llama-model", default=None, help="with --checkpoint-dir: its Llama descriptor (family), if it needs one")
    parser.add_argument("--cache-dir", default=None, help="the demo cache dir (default: LLAMASERVE_CACHE_DIR or ~/.cache/llamaserve)")
    parser.add_argument("--check-tokens", type=int, default=CHECK_TOKENS, help="greedy tokens compared per prompt")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 greedy-token check")
    parser.add_argument("--verbose", action="store_true", help="print the workers' own output")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 sequences of 16 + 8 tokens, one round: checks the script works (tests), numbers meaningless")
    add_results_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.prompt_tokens, args.output_tokens, args.rounds, args.check_tokens = "1,2", 16, 8, 1, 4
    try:
        sys.exit(main_parent(args))
    except WorkerFailed as exc:
        print(exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
