"""Smoke runs of the bench scripts on the 'tiny' config (a few requests each), so they never rot.

These check that each script runs end to end and writes the results format of bench/common.py;
the figures themselves are not checked (a real run is in bench/README.md, not in the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import read_results

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(*argv: str, timeout_s: float = 280) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def rows(path: Path, **where) -> list[dict]:
    return [r for r in read_results(path)["rows"] if all(r.get(k) == v for k, v in where.items())]


def test_forward_smoke(tmp_path):
    out = tmp_path / "forward.json"
    run_script("bench/forward.py", "--configs", "tiny", "--dtypes", "float32", "--batches", "1,2", "--smoke", "--json", str(out))
    decode = rows(out, name="decode", config="tiny", dtype="float32")
    assert [r["batch"] for r in decode] == [1, 2]
    assert all(r["value"] > 0 and r["unit"] == "tok/s" and r["bound"] > 0 for r in decode)
    assert len(rows(out, name="prefill", config="tiny")) == 1



def test_decode_profile_smoke():
    out = run_script("bench/decode_profile.py", "--config", "tiny", "--dtype", "float32", "--threads", "1", "--steps", "2")
    for part in ("decode step", "wqkv", "w13", "attention", "output head", "untimed"):
        assert part in out, out


def test_step_gaps_smoke():
    out = run_script("bench/step_gaps.py", "--config", "tiny", "--dtype", "bfloat16", "--threads", "1", "--rounds", "1", "--steps", "2")
    for part in ("summed over 4 layers", "  attention ", "  w13 ", "past the best rate", "between them", "head best call", "barrier"):
        assert part in out, out

def test_throughput_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    run_script("bench/throughput.py", "--config", "tiny", "--concurrency", "1,2", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--smoke", "--json", str(out))
    tput = rows(out, name="output throughput", config="tiny")
    assert [r["concurrency"] for r in tput] == [1, 2]
    assert all(r["output_tokens"] == r["requests"] * 64 for r in tput)  # ignore_eos: every request ran to max_tokens
    assert tput[1]["floor_tok_s"] == pytest.approx(2 * tput[0]["floor_tok_s"])  # the weights read once a step, for every stream
    assert len(rows(out, name="prefix cache TTFT cached")) == 1


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """Our server on a tiny real-format Llama 3 checkpoint (the e2e fixtures' model)."""
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints, ready_server

    base = tmp_path_factory.mktemp("bench-serve")
    checkpoints = Checkpoints(root=base / "checkpoints", outside=base / "elsewhere")
    checkpoints.root.mkdir()
    with ready_server(BASE_DESCRIPTOR, checkpoints.get(BASE_DESCRIPTOR, seed=0), checkpoints.root) as live:
        yield live


def test_serve_smoke_completions_sweep(live_server, tmp_path):
    out = tmp_path / "sweep.json"
    stdout = run_script("bench/serve.py", "--base-url", live_server.url, "--num-prompts", "4", "--random-input-len", "12",
                        "--random-output-len", "5", "--sweep", "1,2", "--result-filename", str(out), "--disable-tqdm")
    assert "Serving Benchmark Result" in stdout
    data = read_results(out)
    assert data["machine"]["ignore_eos"] is True
    for level in (1, 2):
        assert rows(out, name="failed", max_concurrency=level)[0]["value"] == 0
        # token-id prompts of 12 tokens, output held at 5 tokens by ignore_eos: 4 x (12 + 5) tokens
        total = rows(out, name="total_token_throughput", max_concurrency=level)[0]
        output = rows(out, name="output_throughput", max_concurrency=level)[0]
        assert total["value"] == pytest.approx(output["value"] * 17 / 5)
        assert rows(out, name="ttft p99", max_concurrency=level)[0]["value"] > 0
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_serve_smoke_chat_dataset_reports_failures(live_server, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in (
        {"prompt": "Say hello."},
        {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3},
        {"prompt": "Too long an answer", "max_tokens": 100000},  # beyond the context: a 400 with its body
    )) + "\n")
    out = tmp_path / "chat.json"
    stdout = run_script("bench/serve.py", "--base-url", live_server.url, "--backend", "openai-chat", "--dataset", str(dataset),
                        "--num-prompts", "3", "--random-output-len", "4", "--max-concurrency", "2", "--result-filename", str(out),
                        "--disable-tqdm")
    failed = rows(out, name="failed")[0]
    assert failed["value"] == 1 and "HTTP 400" in failed["errors"][0]
    assert "1 x HTTP 400" in stdout
    assert rows(out, name="e2e_latency p50")[0]["value"] > 0


def test_serve_smoke_responses_vs_chat(live_server):
    """The same greedy prompts through /v1/responses and chat: both complete, with the same token counts."""
    stdout = run_script("bench/serve.py", "--base-url", live_server.url, "--backend", "responses-vs-chat",
                        "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "5",
                        "--max-concurrency", "2", "--disable-tqdm")
    assert "/v1/responses" in stdout and "/v1/chat/completions" in stdout
    assert "responses vs chat at max concurrency 2 (mean of 2 runs each, ABBA): output tok/s" in stdout
    totals = [line for line in stdout.splitlines() if line.startswith("Total generated tokens")]
    assert len(totals) == 5 and len(set(totals)) == 1, totals  # a warm-up, then A B B A; greedy: the same answers


def test_served_itl_smoke(live_server):
    import os

    from tests.e2e.conftest import BASE_DESCRIPTOR

    stdout = run_script("bench/served_itl.py", "--base-url", live_server.url, "--model", BASE_DESCRIPTOR, "--requests", "1",
                        "--max-tokens", "6", "--server-pid", str(os.getpid()))  # the live server runs in this process
    for line in ("engine step", "server inter-token", "client inter-token", "CPU per token", "this client"):
        assert line in stdout, stdout
    stdout = run_script("bench/served_itl.py", "--base-url", live_server.url, "--model", BASE_DESCRIPTOR, "--requests", "3",
                        "--max-tokens", "4", "--concurrency", "2")  # rounds of 2 streams at once, the last of 1
    assert "9 client gaps" in stdout, stdout  # every request streamed: 3 gaps between its 4 chunks


def test_one_stream_smoke(tmp_path):
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints

    checkpoints = Checkpoints(root=tmp_path / "checkpoints", outside=tmp_path / "elsewhere")
    checkpoints.root.mkdir()
    stdout = run_script("bench/one_stream.py", "--checkpoint", str(checkpoints.get(BASE_DESCRIPTOR, seed=0)),
                        "--dtype", "float32", "--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "6")
    lines = stdout.splitlines()
    assert [line.split()[0] for line in lines if line.startswith(("core", "async"))] == ["core", "async"], stdout
    assert sum("step parts, cpu ms: inputs" in line for line in lines) == 2 and "hand-off" in stdout
    stdout = run_script("bench/one_stream.py", "--checkpoint", str(checkpoints.get(BASE_DESCRIPTOR, seed=0)),
                        "--dtype", "float32", "--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "4", "--streams", "3")
    assert sum("step parts, cpu ms: inputs" in line for line in stdout.splitlines()) == 2, stdout
    assert "nan" not in stdout, stdout  # pure-decode steps of 3 sequences were found and timed


def test_one_stream_report_without_gaps():
    """A consumer that took all of a short request's tokens at once leaves no gaps: reported as such,
    not a crash (a loaded CI machine did this to the smoke run above)."""
    from bench.one_stream import gap_ms

    assert gap_ms([]).startswith("n/a")
    assert gap_ms([0.001, 0.003]) == "  2.00 (mean   2.00)"


def test_step_python_smoke(tmp_path):
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints

    checkpoints = Checkpoints(root=tmp_path / "checkpoints", outside=tmp_path / "elsewhere")
    checkpoints.root.mkdir()
    stdout = run_script("bench/step_python.py", "--checkpoint", str(checkpoints.get(BASE_DESCRIPTOR, seed=0)),
                        "--dtype", "float32", "--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "4", "--streams", "2")
    assert "outside the kernels, median: cold" in stdout and "nan" not in stdout, stdout


def test_heap_allocations_smoke_with_the_shim(tmp_path):
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints

    checkpoints = Checkpoints(root=tmp_path / "checkpoints", outside=tmp_path / "elsewhere")
    checkpoints.root.mkdir()
    shim = tmp_path / "alloc_shim.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(shim), "bench/alloc_shim.c", "-ldl"], cwd=REPO, check=True)
    argv = ["bench/heap_allocations.py", "--checkpoint", str(checkpoints.get(BASE_DESCRIPTOR, seed=0)), "--dtype", "float32",
            "--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "4", "--streams", "2"]
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "LD_PRELOAD": str(shim)})
    assert done.returncode == 0, done.stderr[-3000:]
    round_line = next(line for line in done.stdout.splitlines() if line.startswith("round 0:"))
    assert "step CPU" in round_line and "large allocations" in round_line and "not counted" not in round_line, done.stdout


def test_responses_overhead_smoke():
    stdout = run_script("bench/responses_overhead.py", "--tokens", "200", "--rounds", "1")
    assert [line.split()[0] for line in stdout.splitlines()] == ["chat", "responses", "messages"]


def test_serve_help_uses_vllm_flag_names():
    stdout = run_script("bench/serve.py", "--help")
    for flag in ("--base-url", "--model", "--num-prompts", "--random-input-len", "--random-output-len", "--dataset",
                 "--max-concurrency", "--request-rate", "--sweep", "--backend"):
        assert flag in stdout


def test_demo_vs_llamacpp_smoke_ours_only(tmp_path):
    """The demo comparison's own half (the llama-server half needs a 10-minute build: a real run)."""
    from engine.loading.demo import DemoUnavailable, default_cache_dir, ensure_demo_checkpoint

    try:
        ensure_demo_checkpoint(default_cache_dir(), progress=False)
    except DemoUnavailable as exc:
        pytest.skip(f"demo model unavailable: {exc}")
    stdout = run_script("bench/demo_vs_llamacpp.py", "--skip-llamacpp", "--rounds", "1", "--streams", "1,2", "--prompt-tokens", "8",
                        "--output-tokens", "4", "--smoke", "--out", str(tmp_path / "three_way"))
    table = stdout.split("llamaserve (median of 1 rounds")[1].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["1", "2"]  # one row per stream count
    rows_md = [line for line in (tmp_path / "three_way.md").read_text().splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in rows_md] == ["streams", "1", "2"]  # header, then one row per stream count
    assert (tmp_path / "three_way.png").read_bytes().startswith(b"\x89PNG")


def test_demo_vs_llamacpp_help_names_the_three_servers():
    stdout = run_script("bench/demo_vs_llamacpp.py", "--help")
    for word in ("--servers", "--dtype", "--streams", "--out", "llama-server", "vllm"):
        assert word in stdout


@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0"])
def test_gguf_convert_keeps_metadata_and_values(tmp_path, kind):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from bench.gguf_convert import convert
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    src = tmp_path / "q4.gguf"
    write_gguf(src, hf_weights(seed=1, tied=False), qtype=gguf.GGMLQuantizationType.Q4_1)
    convert(src, tmp_path / "out.gguf", kind, progress=False)
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "out.gguf")
    assert int(after.fields["general.file_type"].contents()) == int(getattr(gguf.LlamaFileType, {"F32": "ALL_F32", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}[kind]))
    assert after.fields["tokenizer.chat_template"].contents() == before.fields["tokenizer.chat_template"].contents()
    tolerance = {"F32": 0.0, "BF16": 2**-8, "Q8_0": 2**-6}[kind]
    for old, new in zip(before.tensors, after.tensors):
        assert old.name == new.name
        a = gguf.quants.dequantize(old.data, old.tensor_type).astype(np.float32)
        b = gguf.quants.dequantize(new.data, new.tensor_type).astype(np.float32)
        expected_type = "F32" if kind == "F32" or a.ndim < 2 else kind
        assert new.tensor_type.name == expected_type
        np.testing.assert_allclose(b, a, rtol=tolerance, atol=tolerance * np.abs(a).max())


def test_gguf_convert_f32_imports_to_the_same_checkpoint(tmp_path):
    """F32 holds exactly the values our importer reads from the quantized file: both servers compute on the same weights."""
    gguf = pytest.importorskip("gguf")
    import torch

    from bench.gguf_convert import convert
    from engine.loading.gguf_import import import_gguf
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    write_gguf(tmp_path / "q4.gguf", hf_weights(seed=2, tied=True), qtype=gguf.GGMLQuantizationType.Q4_1)
    convert(tmp_path / "q4.gguf", tmp_path / "f32.gguf", "F32", progress=False)
    a = torch.load(import_gguf(tmp_path / "q4.gguf", tmp_path / "a", progress=False) / "consolidated.00.pth", weights_only=True)
    b = torch.load(import_gguf(tmp_path / "f32.gguf", tmp_path / "b", progress=False) / "consolidated.00.pth", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_rss_smoke(tmp_path):
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints

    checkpoints = Checkpoints(root=tmp_path / "checkpoints", outside=tmp_path / "elsewhere")
    checkpoints.root.mkdir()
    stdout = run_script("bench/load_rss.py", "--checkpoint", str(checkpoints.get(BASE_DESCRIPTOR, seed=0)))
    report = json.loads(stdout.splitlines()[-1])
    assert report["weight_bytes_mib"] > 0 and report["rss_after_load_mib"] >= report["rss_before_mib"], stdout


def test_server_overhead_smoke():
    stdout = run_script("bench/server_overhead.py", "--tokens", "20", "--streams", "2", "--concurrency", "2", "--requests", "4")
    assert "server CPU per streamed token" in stdout and "2 streams x 20 tokens (40 chunks)" in stdout
    stdout = run_script("bench/server_overhead.py", "--engine", "async", "--tokens", "5", "--streams", "3",
                        "--concurrency", "2", "--requests", "0")
    assert "3 streams x 5 tokens (15 chunks), concurrency 2, async engine" in stdout and "thread main" in stdout, stdout


def test_step_memory_smoke():
    stdout = run_script("bench/step_memory.py", "--what", "linear", "--steps", "6", "--warmup-steps", "2", "--max-rows", "40",
                        "--candidates", "none,buckets+trim")
    assert "  none " in stdout and "  buckets+trim " in stdout, stdout
    stdout = run_script("bench/step_memory.py", "--speed", "--speed-rows", "2,17", "--repeats", "1", "--layers", "1", "--max-rows", "40")
    assert "rows   17 ->   18: x" in stdout and "40-row step: malloc_trim(0)" in stdout, stdout


def test_read_bandwidth_smoke():
    stdout = run_script("bench/read_bandwidth.py", "--threads", "1", "--mib", "4", "--rounds", "1", "--streams", "1,2", "--prefetch", "0",
                        "--dtypes", "float32", "--layers", "1", "--vocab", "0")
    for part in ("1 thread(s) read, 2 stream(s)", "copy", "float32 step linears", "of read"):
        assert part in stdout, stdout


def test_gemm_linear_smoke():
    stdout = run_script("bench/gemm_linear.py", "--shapes", "64x48", "--rows", "2,9", "--rounds", "1", "--cold-mb", "1")
    assert "[64x48] rows    9: onednn" in stdout and "onednn/gemm" in stdout, stdout
    stdout = run_script("bench/gemm_linear.py", "--dtype", "bfloat16", "--shapes", "64x48", "--rows", "2,17", "--rounds", "1", "--cold-mb", "1")
    assert "bfloat16 weights" in stdout and "[64x48] rows   17: widened" in stdout and "widened/gemm" in stdout, stdout
    stdout = run_script("bench/gemm_linear.py", "--shapes", "64x48", "--rows", "9", "--rounds", "1", "--cold-mb", "1", "--huge-pages")
    assert "gemm weights on a huge-page arena" in stdout and "[64x48] rows    9: onednn" in stdout, stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name != "common.py"))
def test_every_bench_script_imports_and_explains_itself(script):
    """--help imports each script's engine and server pieces: a renamed module or class fails here,
    for the scripts whose full runs are too long for the suite too."""
    assert "usage:" in run_script(f"bench/{script}", "--help", timeout_s=120)


def test_lora_smoke(tmp_path):
    out = tmp_path / "lora.json"
    run_script("bench/lora.py", "--config", "tiny", "--streams", "1,2", "--rank", "4", "--smoke", "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--adapter-dir", str(tmp_path / "adapters"), "--json", str(out))
    tput = rows(out, name="output throughput", config=None)
    assert {(r["mode"], r["streams"]) for r in tput} == {(m, s) for m in ("base", "one adapter", "8 adapters") for s in (1, 2)}
    assert all(r["value"] > 0 for r in tput)
    assert len(rows(out, name="8 adapters / base step time")) == 1
    stdout = run_script("bench/lora.py", "--delta", "--config", "tiny", "--streams", "8", "--rank", "4", "--smoke")
    assert "feed_forward.w13" in stdout and "a step's deltas (4 layers)" in stdout, stdout


def test_gguf_convert_q4_k_m_mixes_as_llama_cpp_does(tmp_path):
    """Q4_K_M: Q6_K for the head and for attn_v / ffn_down where llama.cpp's use_more_bits says
    (of 2 layers: the last), Q4_K elsewhere; rows not whole super-blocks fall back to Q8_0."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from bench.gguf_convert import convert
    from tests.engine.test_gguf_import import hf_weights, write_gguf
    from tests.engine.test_kquant_model import write_kquant_gguf

    write_kquant_gguf(tmp_path / "src.gguf", seed=1)
    convert(tmp_path / "src.gguf", tmp_path / "km.gguf", "Q4_K_M", progress=False)
    before, after = gguf.GGUFReader(tmp_path / "src.gguf"), gguf.GGUFReader(tmp_path / "km.gguf")
    types = {t.name: t.tensor_type.name for t in after.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert int(after.fields["general.file_type"].contents()) == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for old, new in zip(before.tensors, after.tensors):
        a = gguf.quants.dequantize(old.data, old.tensor_type).astype(np.float32)
        b = gguf.quants.dequantize(new.data, new.tensor_type).astype(np.float32)
        np.testing.assert_allclose(b, a, atol=0.15 * np.abs(a).max())
    write_gguf(tmp_path / "narrow.gguf", hf_weights(seed=1, tied=False))  # 64 columns: no K-quant fits
    convert(tmp_path / "narrow.gguf", tmp_path / "narrow_km.gguf", "Q4_K_M", progress=False)
    assert {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "narrow_km.gguf").tensors} == {"Q8_0", "F32"}


def test_vision_smoke(tmp_path):
    pytest.importorskip("llama_models")
    out = tmp_path / "vision.json"
    stdout = run_script("bench/vision.py", "--size", "tiny", "--images", "0,1", "--concurrency", "1,2",
                        "--max-tokens", "3", "--json", str(out))
    assert "1 image(s), 2 concurrent" in stdout
    assert {r["images"] for r in rows(out, name="output_tok_s")} == {0, 1}
    assert rows(out, name="memory_per_image_in_flight")[0]["chunks"] == 5
