"""LoRA adapters served unmerged: reading torchtune's and PEFT's files, and the base plus two
adapters in one batch, each equal to llama-models' reference forward with that adapter merged
into the weights (W + scale * B @ A)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.kernels.cpu import load_cpu_kernels
from engine.lora.adapters import AdapterError, read_adapter
from engine.types import EngineRequest, InvalidRequest, SamplingParams
from tests.engine.fakes import ByteTokenizer
from tests.engine.lora_fixtures import write_peft, write_torchtune

MAX_SEQ_LEN = 64
NEW_TOKENS = 6
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 2, 3], [9, 9, 8, 120, 33, 64, 77, 12, 5, 6, 7]]


@pytest.fixture(scope="module")
def args(tiny_model_args):
    return tiny_model_args


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, args):
    root = tmp_path_factory.mktemp("adapters")
    return {"tt": write_torchtune(root / "tt", args), "peft": write_peft(root / "peft", args)}


@pytest.fixture(scope="module")
def full_state(tiny_checkpoint):
    return torch.load(tiny_checkpoint / "consolidated.00.pth", weights_only=True)


# --------------------------------------------------------------------------- reading
@pytest.mark.parametrize("kind", ["torchtune", "torchtune-meta", "peft-safetensors", "peft-bin"])
def test_each_format_reads_back_in_meta_order(tmp_path, args, kind):
    written = {
        "torchtune": lambda: write_torchtune(tmp_path / "a", args),
        "torchtune-meta": lambda: write_torchtune(tmp_path / "a", args, meta_names=True),
        "peft-safetensors": lambda: write_peft(tmp_path / "a", args),
        "peft-bin": lambda: write_peft(tmp_path / "a", args, fmt="bin", rslora=False),
    }[kind]()
    adapter = read_adapter(written.folder, args, max_rank=16)
    assert adapter.scale == pytest.approx(written.scale)
    assert set(adapter.weights) == set(written.weights)
    for name, (a, b) in written.weights.items():
        torch.testing.assert_close(adapter.weights[name][0], a, rtol=0, atol=0)
        torch.testing.assert_close(adapter.weights[name][1], b, rtol=0, atol=0)  # q/k un-permuted exactly


def _rewrite(folder, **config_changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda f, a: None, "rank 8 is above --max-lora-rank 4"),
        (lambda f, a: _rewrite(f, r=6), "attention.wk has lora_A [8, 64] and lora_B [32, 8]; this base needs [6, 64]"),
        (lambda f, a: _rewrite(f, use_dora=True), "use_dora is set"),
        (lambda f, a: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda f, a: (f / "adapter_model.safetensors").unlink(), "no adapter weights"),
    ],
)
def test_a_bad_adapter_is_refused_naming_what_differs(tmp_path, args, break_it, message):
    folder = write_peft(tmp_path / "a", args).folder
    break_it(folder, args)
    max_rank = 4 if "max-lora-rank" in message else 16
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        read_adapter(folder, args, max_rank=max_rank)
    assert info.value.code == "invalid_adapter"


def test_unknown_module_and_other_base_are_refused(tmp_path, args):
    folder = write_torchtune(tmp_path / "a", args).folder
    state = torch.load(folder / "adapter_model.pt", weights_only=True)
    state["layers.0.attn.rotary.lora_a.weight"] = torch.zeros(4, 64)
    torch.save(state, folder / "adapter_model.pt")
    with pytest.raises(AdapterError, match="module 'rotary'"):
        read_adapter(folder, args, max_rank=16)
    other = write_torchtune(tmp_path / "b", dataclasses.replace(args, n_layers=3)).folder
    with pytest.raises(AdapterError, match="for layer 2; the base has 2 layers"):
        read_adapter(other, args, max_rank=16)


# --------------------------------------------------------------------------- serving
def reference_greedy(state, args, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """llama-models' own Transformer on `state`: greedy tokens and their logprobs."""
    reference = pytest.importorskip("llama_models.llama3.model")
    from llama_models.llama3.args import ModelArgs as MetaArgs

    from engine.executor.parallel import destroy_group, init_group

    args = dataclasses.replace(args, rope_scaling_factor=None)  # the reference hard-codes Llama 3.1's 8
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    try:
        model = reference.Transformer(MetaArgs(**args.to_params(), max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
        model.load_state_dict(state, strict=True)
        tokens, logprobs = list(prompt), []
        with torch.inference_mode():
            logits, pos = model(torch.tensor([tokens]), 0)[0, -1], len(tokens)
            for _ in range(num_new):
                lp = torch.log_softmax(logits.double(), -1)
                token = int(lp.argmax())
                tokens.append(token)
                logprobs.append(float(lp[token]))
                logits, pos = model(torch.tensor([[token]]), pos)[0, -1], pos + 1
    finally:
        destroy_group()
    return tokens[len(prompt):], logprobs


def engine_config(**overrides) -> EngineConfig:
    base = dict(dtype="float32", block_size_tokens=4, max_batch_size=16, max_num_batched_tokens=64, max_prefill_chunk_tokens=0,
                kv_cache_bytes=4 << 20, max_loras=4, max_lora_rank=16)
    return EngineConfig(**{**base, **overrides})


def make_engine(tiny_checkpoint, cfg: EngineConfig) -> AsyncEngine:
    from engine.executor.executor import ModelExecutor
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.checkpoint import resolve_checkpoint

    # a Llama 3.1 descriptor: its RoPE scaling factor (8) is the one llama-models' reference hard-codes
    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model="Llama3.1-8B-Instruct")
    runner = ModelExecutor(WorkerGroup(spec, cfg, max_seq_len=MAX_SEQ_LEN))
    return AsyncEngine("tiny", runner, ByteTokenizer(), None, cfg, max_seq_len=MAX_SEQ_LEN)


def request(rid: str, prompt: list[int], lora: str | None, num_new: int = NEW_TOKENS) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=num_new, logprobs=0, ignore_eos=True)
    return EngineRequest(rid, list(prompt), params, lora_name=lora)


async def run_all(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list[float]]]:
    async def one(req: EngineRequest):
        tokens, logprobs = [], []
        async for out in engine.generate(req):
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
        return tokens, logprobs

    results = await asyncio.gather(*(one(r) for r in requests))
    return {r.request_id: res for r, res in zip(requests, results)}


@pytest.fixture(scope="module")
def expected(full_state, args, adapters):
    states = {None: full_state, "tt": adapters["tt"].merged(full_state), "peft": adapters["peft"].merged(full_state)}
    return {(lora, i): reference_greedy(states[lora], args, prompt, NEW_TOKENS)
            for lora in states for i, prompt in enumerate(PROMPTS)}


def check_against_reference(got, expected):
    for (lora, i), (tokens, logprobs) in expected.items():
        got_tokens, got_logprobs = got[f"{lora}-{i}"]
        assert got_tokens == tokens, (lora, i)
        assert got_logprobs == pytest.approx(logprobs, abs=2e-3), (lora, i)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


@pytest.mark.parametrize(("device", "cpu_kernels"), [("cpu", True), ("cpu", False), pytest.param("cuda", False, marks=CUDA)])
async def test_base_and_two_adapters_in_one_batch_equal_the_merged_reference(tiny_checkpoint, adapters, expected, device, cpu_kernels):
    """On the CPU kernels the adapters run as one segmented_lora call per linear; without them, and
    on CUDA, as torch matmuls per run of rows (float32, as the reference)."""
    engine = make_engine(tiny_checkpoint, engine_config(device=device, cpu_kernels=cpu_kernels))
    try:
        assert await engine.load_adapter("tt", adapters["tt"].folder) > 0
        assert await engine.load_adapter("peft", adapters["peft"].folder) > 0
        lora = engine.runner._workers._shard.lora
        assert (lora.kernels is not None) == (cpu_kernels and load_cpu_kernels() is not None)
        requests = [request(f"{lora}-{i}", p, lora) for lora in (None, "tt", "peft") for i, p in enumerate(PROMPTS)]
        got = await run_all(engine, requests)
        check_against_reference(got, expected)
        # the adapters change what the base says (non-zero B), and the prefix cache never mixes them up:
        assert got["tt-0"] != got["None-0"] and got["peft-0"] != got["tt-0"]
        again = await run_all(engine, [request(f"{lora}-0", PROMPTS[0], lora) for lora in ("tt", None, "peft")])
        for key, (tokens, logprobs) in again.items():  # prefix-cache hits now: each on its own adapter's blocks
            assert tokens == got[key][0] and logprobs == pytest.approx(got[key][1], abs=1e-5)
        assert engine.core.pool.prefix_hits_tokens > 0
        assert engine.core.pool.num_free == engine.core.pool.num_blocks
        assert engine.adapter_requests_total() == {"tt": 4, "peft": 4}
    finally:
        await engine.shutdown()


async def test_more_adapters_than_max_loras_queue_and_never_fail(tiny_checkpoint, adapters, expected):
    engine = make_engine(tiny_checkpoint, engine_config(max_loras=1))
    try:
        await engine.load_adapter("tt", adapters["tt"].folder)
        await engine.load_adapter("peft", adapters["peft"].folder)
        steps, activity = [], []
        original = engine.core.scheduler.schedule

        def spy():
            batch = original()
            steps.append({seq.lora_id for seq in batch.seqs if seq.lora_id})
            activity.append(engine.adapter_activity())
            return batch

        engine.core.scheduler.schedule = spy
        requests = [request(f"{lora}-{i}", p, lora) for lora in ("tt", "peft", None) for i, p in enumerate(PROMPTS)]
        check_against_reference(await run_all(engine, requests), expected)
        assert max(len(s) for s in steps) == 1  # never two adapters in one step
        assert (["tt"], ["peft"]) in activity  # what vllm:lora_requests_info shows: one running, one waiting
    finally:
        await engine.shutdown()


async def test_swap_and_unload_while_requests_run(tiny_checkpoint, adapters, expected):
    engine = make_engine(tiny_checkpoint, engine_config())
    try:
        await engine.load_adapter("ada", adapters["tt"].folder)
        first = asyncio.ensure_future(run_all(engine, [request(f"tt-{i}", p, "ada") for i, p in enumerate(PROMPTS)]))
        await asyncio.sleep(0)  # queued on the old version
        await engine.load_adapter("ada", adapters["peft"].folder)  # swapped: running requests keep the old weights
        second = await run_all(engine, [request(f"peft-{i}", p, "ada") for i, p in enumerate(PROMPTS)])
        got = {**await first, **second}
        check_against_reference(got, {k: v for k, v in expected.items() if k[0] is not None})
        assert await engine.unload_adapter("ada")
        assert engine.adapter_names() == []
        with pytest.raises(InvalidRequest, match="not loaded"):
            engine.generate(request("x", PROMPTS[0], "ada"))
        worker = engine.runner._workers._shard
        assert worker.lora.adapters == {}  # every version's weights are gone
        base = await run_all(engine, [request("None-0", PROMPTS[0], None)])
        assert base["None-0"][0] == expected[(None, 0)][0]
    finally:
        await engine.shutdown()


@pytest.mark.timeout(240)
async def test_model_parallel_2_equals_the_merged_reference(tiny_checkpoint, adapters, expected):
    """Adapters cut across two ranks as their base linears are (one spawned follower, gloo)."""
    engine = make_engine(tiny_checkpoint, engine_config(model_parallel_size=2))
    try:
        await engine.load_adapter("tt", adapters["tt"].folder)
        await engine.load_adapter("peft", adapters["peft"].folder)
        requests = [request(f"{lora}-{i}", p, lora) for lora in (None, "tt", "peft") for i, p in enumerate(PROMPTS)]
        check_against_reference(await run_all(engine, requests), expected)
        assert await engine.unload_adapter("tt")  # the follower drops its cut too, and keeps serving
        got = await run_all(engine, [request("peft-1", PROMPTS[1], "peft")])
        assert got["peft-1"][0] == expected[("peft", 1)][0]
    finally:
        await engine.shutdown()


async def test_max_loras_0_serves_no_adapter(tiny_checkpoint, adapters):
    engine = make_engine(tiny_checkpoint, engine_config(max_loras=0))
    try:
        with pytest.raises(InvalidRequest, match="serves no LoRA adapters") as info:
            await engine.load_adapter("tt", adapters["tt"].folder)
        assert info.value.code == "lora_disabled" and engine.adapter_names() == []
        assert engine.runner._workers._shard.lora is None  # no linear was wrapped
    finally:
        await engine.shutdown()


async def test_speculating_adapters_equal_the_merged_reference(tiny_checkpoint, adapters, expected):
    """ngram speculation on the base and two adapters in one batch: a speculating sequence's draft
    rows are query groups of their own (engine/executor/step_inputs.py), each with its adapter."""
    from engine.spec.config import SpeculativeConfig

    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1)
    engine = make_engine(tiny_checkpoint, engine_config(speculative_config=ngram))
    try:
        await engine.load_adapter("tt", adapters["tt"].folder)
        await engine.load_adapter("peft", adapters["peft"].folder)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)  # no logprobs: they speculate
        requests = [dataclasses.replace(request(f"{lora}-{i}", p, lora), params=greedy)
                    for lora in (None, "tt", "peft") for i, p in enumerate(PROMPTS)]
        got = await run_all(engine, requests)
        for (lora, i), (tokens, _) in expected.items():
            assert got[f"{lora}-{i}"][0] == tokens, (lora, i)
        assert engine.core.stats().spec_decode_num_drafts_total > 0
    finally:
        await engine.shutdown()
