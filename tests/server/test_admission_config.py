"""The admission options (issue 29, finding 4): flags, env and run.yaml reach EngineConfig; nonsense is refused."""

from __future__ import annotations

import pytest

from server.__main__ import make_parser
from server.config import ConfigError, build_config


def config(argv: list[str], env: dict[str, str] | None = None):
    return build_config(make_parser().parse_args(argv), env=env or {})


def test_admission_options_reach_the_engine_config(tmp_path):
    engine = config(["--max-waiting-batch-sequences", "64", "--max-sequences-per-request", "16"],
                    {"LLAMASERVE_MAX_WAITING_REQUESTS": "128"}).engine
    assert (engine.max_waiting_requests, engine.max_waiting_batch_sequences, engine.max_sequences_per_request) == (
        128, 64, 16)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("engine: {max_waiting_batch_sequences: 8, max_sequences_per_request: 4}\n")
    from_yaml = config(["--config", str(run_yaml)]).engine
    assert (from_yaml.max_waiting_batch_sequences, from_yaml.max_sequences_per_request) == (8, 4)
    defaults = config([]).engine
    assert defaults.max_sequences_per_request < defaults.max_waiting_requests


@pytest.mark.parametrize("flag", ["--max-waiting-requests", "--max-waiting-batch-sequences",
                                  "--max-sequences-per-request"])
def test_admission_bounds_below_one_are_refused(flag):
    with pytest.raises(ConfigError, match=flag.lstrip("-").replace("-", "_")):
        config([flag, "0"])
