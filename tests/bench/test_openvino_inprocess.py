"""Smoke runs of bench/openvino_inprocess.py (issue 35): our half on a tiny checkpoint always; both
engines on the demo where bench/openvino_setup.sh has made the OpenVINO venv and IR (skipped otherwise).
The figures are not checked; the greedy-token agreement in float32 is."""

from __future__ import annotations

import pytest

from bench.common import read_results
from bench.openvino_inprocess import DEFAULT_OV_MODEL, DEFAULT_OV_PYTHON
from tests.bench.test_bench_smoke import run_script

pytestmark = pytest.mark.slow


def rows(path, **where) -> list[dict]:
    return [r for r in read_results(path)["rows"] if all(r.get(k) == v for k, v in where.items())]


def test_ours_alone_on_a_tiny_checkpoint(tmp_path):
    from tests.e2e.conftest import BASE_DESCRIPTOR, Checkpoints

    checkpoint = Checkpoints(root=tmp_path / "ckpt", outside=tmp_path / "elsewhere").get(BASE_DESCRIPTOR, seed=0)
    out = tmp_path / "ours.json"
    stdout = run_script("bench/openvino_inprocess.py", "--engines", "llamaserve", "--smoke", "--checkpoint-dir", str(checkpoint),
                        "--llama-model", BASE_DESCRIPTOR, "--json", str(out))  # fmt: skip
    assert "| 2 |" in stdout, stdout  # the markdown table has the 2-sequence row
    tput = rows(out, name="output throughput", engine="llamaserve")
    assert [r["concurrency"] for r in tput] == [1, 2]
    assert all(r["value"] > 0 for r in tput)
    assert all(r["value"] > 0 for r in rows(out, name="TPOT p50"))
    assert not rows(out, name="greedy tokens match")  # one engine: nothing to compare


def test_ours_against_openvino_on_the_demo(tmp_path):
    if not DEFAULT_OV_PYTHON.is_file() or not (DEFAULT_OV_MODEL / "openvino_model.xml").is_file():
        pytest.skip(f"OpenVINO GenAI not set up ({DEFAULT_OV_PYTHON}, {DEFAULT_OV_MODEL}): run bench/openvino_setup.sh")
    from engine.loading.demo import DemoUnavailable, default_cache_dir, ensure_demo_checkpoint

    try:
        ensure_demo_checkpoint(default_cache_dir(), progress=False)
    except DemoUnavailable as exc:
        pytest.skip(f"demo model unavailable: {exc}")
    out = tmp_path / "both.json"
    stdout = run_script("bench/openvino_inprocess.py", "--smoke", "--json", str(out), timeout_s=600)
    # the same fp32 weights on both sides: the first greedy tokens of every chat prompt agree
    assert "greedy tokens match: yes" in stdout, stdout
    assert rows(out, name="greedy tokens match")[0]["value"] == 1.0
    for engine in ("llamaserve", "openvino"):
        assert [r["concurrency"] for r in rows(out, name="output throughput", engine=engine)] == [1, 2]
    assert "llamaserve / openvino" in stdout
