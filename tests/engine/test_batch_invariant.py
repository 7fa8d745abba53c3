"""--batch-invariant (EngineConfig.batch_invariant): a request's greedy tokens and logprobs are bit
for bit the same alone and batched with others (other lengths, its prefill beside their decodes),
in float32 and bfloat16, on the fused-kernel backend and on the torch/oneDNN one."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.types import EngineRequest, SamplingParams
from tests.engine.fakes import ByteTokenizer
from tests.engine.test_engine_real import BLOCK_SIZE, MAX_SEQ_LEN, make_runner, spec  # noqa: F401 (fixture)

TOK = ByteTokenizer()
TARGET = [7, 99, 3, 250, 18, 64, 1, 200, 45, 45, 9, 130, 77]  # 13 tokens: a partial last block


def engine(spec, dtype: str, cpu_kernels: bool, batch_invariant: bool = True, quantization: str | None = None) -> EngineCore:
    # the prefix cache off and a budget that fits every prompt in one chunk: the target's prefill is
    # the same one chunk alone and batched (a different chunking is a different computation)
    cfg = EngineConfig(
        dtype=dtype, block_size_tokens=BLOCK_SIZE, max_batch_size=16, max_num_batched_tokens=256, kv_cache_bytes=4 << 20,
        enable_prefix_caching=False, cpu_kernels=cpu_kernels, batch_invariant=batch_invariant, quantization=quantization,
    )  # fmt: skip
    return EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)


def request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(temperature=0.0, logprobs=4, max_tokens=max_tokens))


def run(core: EngineCore, early: list[EngineRequest], late: list[EngineRequest]) -> dict[str, list]:
    """`early` requests start first and decode for two steps; `late` ones then join (their prefills
    beside the others' decodes). Each request's (token, logprob, top-4) per generated token."""
    got: dict[str, list] = {}

    def step() -> None:
        for out in core.step():
            got.setdefault(out.request_id, []).extend((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or [])

    for r in early:
        core.add_request(r)
    for _ in range(3 if early else 0):
        step()
    for r in late:
        core.add_request(r)
    while core.has_unfinished:
        step()
    return got


def others() -> tuple[list[EngineRequest], list[EngineRequest]]:
    early = [request("a", list(range(5, 28)), 12), request("b", [3, 4], 14), request("c", list(range(40, 47)), 10)]
    late = [request("d", list(range(100, 131)), 6), request("e", [9], 9)]
    return early, late


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch_ops"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_and_batched_give_bit_identical_logprobs(spec, dtype, cpu_kernels, monkeypatch):  # noqa: F811
    import engine.backends.cpu as cpu_backends

    if cpu_kernels and dtype == "bfloat16":
        # the bfloat16 kernel backend as an AVX2 CPU selects it (oneDNN without bfloat16), on every CPU:
        # no AMX tiles either (test_amx_tiles_alone_and_batched has them)
        monkeypatch.setattr(cpu_backends, "packing_available", lambda dtype: str(dtype) != "torch.bfloat16")
        monkeypatch.setattr(cpu_backends, "load_amx_linear", lambda: None)
    target = request("t", TARGET, 10)
    alone = run(engine(spec, dtype, cpu_kernels), [], [target])["t"]
    early, late = others()
    core = engine(spec, dtype, cpu_kernels)
    batched = run(core, early, [target, *late])["t"]
    model = core.runner._workers._shard.model
    assert model.backend.dtype == getattr(__import__("torch"), dtype) and model.backend.batch_invariant
    from engine.kernels.cpu import load_cpu_kernels

    assert (model.backend.name == "cpu_kernels") == (cpu_kernels and load_cpu_kernels() is not None)
    assert len(alone) == 10
    assert batched == alone  # tokens, logprobs and top-4 alternatives, bit for bit


def test_amx_tiles_alone_and_batched(spec):  # noqa: F811
    """On AMX CPUs the mode runs every bfloat16 row count on the tiles (a row's sums there do not
    depend on the others): block linears and head on them at one row as at many, the compiled step's
    one row too (pairs_min_rows 1), and the logprobs still bit for bit alone and batched."""
    from engine.backends.cpu import InterleavedHeadLinear, PackedCpuLinear

    target = request("t", TARGET, 10)
    alone_core = engine(spec, "bfloat16", True)
    model = alone_core.runner._workers._shard.model
    if model.backend.name != "cpu_kernels" or model.backend.amx is None:
        pytest.skip("no AMX bfloat16 tiles (or no fused CPU kernels) here")
    linears = [m for m in model.modules() if isinstance(m, PackedCpuLinear)]
    tiled = [m for m in linears if m._many_rows is not None]
    assert tiled and all(m.pairs_on_tiles() for m in tiled)
    assert isinstance(model.output, InterleavedHeadLinear) and model.output._amx is not None
    step = model.decode_step
    if len(tiled) == len(linears):
        assert step is not None and step._program.pairs_min_rows == 1 and step._program.max_rows > 1
    else:  # some weights the tiles refuse: no compiled step (it would run their one row elsewhere)
        assert step is None
    alone = run(alone_core, [], [target])["t"]
    early, late = others()
    batched = run(engine(spec, "bfloat16", True), early, [target, *late])["t"]
    assert len(alone) == 10 and batched == alone


@pytest.mark.parametrize("quantization", ["int8", "int4_mixed"])
def test_quantized_linears_run_row_by_row(spec, quantization):  # noqa: F811
    """A quantized linear's kernel may depend on the rows: the mode calls it one row at a time."""
    from engine.backends.base import RowByRow

    target = request("t", TARGET, 8)
    alone = run(engine(spec, "float32", True, quantization=quantization), [], [target])["t"]
    early, late = others()
    core = engine(spec, "float32", True, quantization=quantization)
    batched = run(core, early, [target, *late])["t"]
    wqkv = core.runner._workers._shard.model.layers[0].attention.wqkv
    assert isinstance(wqkv, RowByRow) and batched == alone


def test_the_mode_builds_batch_invariant_paths(spec):  # noqa: F811
    """What the mode changes, so the test above cannot pass by luck: in float32 every block linear
    and the head on the one-row kernel (no oneDNN copy, no tiles), the invariant decode attention."""
    from engine.backends.cpu import InterleavedHeadLinear, PackedCpuLinear

    model = engine(spec, "float32", True).runner._workers._shard.model
    if model.backend.name != "cpu_kernels":
        pytest.skip("no fused CPU kernels here")
    linears = [m for m in model.modules() if isinstance(m, PackedCpuLinear)]
    assert linears and all(m.packed_weight is None and m._invariant for m in linears)
    assert isinstance(model.output, InterleavedHeadLinear) and model.backend.amx is None and model.output._amx is None


def test_flag_env_and_run_yaml_reach_the_engine_config(tmp_path):  # noqa: F811
    from server.__main__ import make_parser
    from server.config import build_config

    def engine_config(argv: list[str], env: dict[str, str] | None = None) -> EngineConfig:
        return build_config(make_parser().parse_args(argv), env=env or {}).engine

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("engine: {batch_invariant: true}\n")
    assert not engine_config([]).batch_invariant
    assert engine_config(["--batch-invariant"]).batch_invariant
    assert engine_config([], {"LLAMASERVE_BATCH_INVARIANT": "1"}).batch_invariant
    assert engine_config(["--config", str(run_yaml)]).batch_invariant
    assert not engine_config(["--config", str(run_yaml), "--no-batch-invariant"]).batch_invariant
