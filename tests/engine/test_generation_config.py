"""generation_config.json -> the sampling defaults a checkpoint's requests get (as vLLM reads it)."""

from __future__ import annotations

import json

import pytest

from engine.loading.generation_config import read_sampling_defaults, write_generation_config
from engine.types import CheckpointError, SamplingDefaults


def write(tmp_path, body) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(body))


def test_no_file_means_openais_defaults(tmp_path):
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                                                repetition_penalty=1.0)


def test_the_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    write(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                     "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "max_new_tokens": 99})
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                                                repetition_penalty=1.05)


def test_keys_left_out_or_null_keep_openais_and_top_k_off_is_0(tmp_path):
    write(tmp_path, {"temperature": None, "top_p": 0.8, "top_k": -1})
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(top_p=0.8)


@pytest.mark.parametrize("body,match", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": True}, "top_p must be a number"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -1}, "temperature must be >= 0"),
    ([1, 2], "expected a JSON object"),
])
def test_values_the_sampler_cannot_use_are_refused_naming_the_file(tmp_path, body, match):
    write(tmp_path, body)
    with pytest.raises(CheckpointError, match=match) as info:
        read_sampling_defaults(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_unreadable_json_is_a_checkpoint_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_sampling_defaults(tmp_path)


def test_written_defaults_read_back(tmp_path):
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9)
    path = write_generation_config(tmp_path, defaults)
    assert json.loads(path.read_text()) == {"temperature": 0.2, "top_p": 0.9, "do_sample": True}
    assert read_sampling_defaults(tmp_path) == defaults
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]  # no scratch file left


def test_the_demo_converter_writes_smollm2s_published_defaults(tmp_path):
    from engine.loading.demo import DEMO_SAMPLING_DEFAULTS, _ensure_generation_config

    assert DEMO_SAMPLING_DEFAULTS == SamplingDefaults(temperature=0.2, top_p=0.9)
    _ensure_generation_config(tmp_path)  # a cache converted before the file existed gets it
    assert read_sampling_defaults(tmp_path) == DEMO_SAMPLING_DEFAULTS
    write(tmp_path, {"temperature": 0.7})
    _ensure_generation_config(tmp_path)  # a file the user edited is kept
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.7)
