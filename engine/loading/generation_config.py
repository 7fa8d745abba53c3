"""A checkpoint's generation_config.json -> the sampling defaults its requests get.

vLLM (by default, `--generation-config auto`) uses a model's published temperature / top_p /
top_k / min_p / repetition_penalty for requests that leave them out; so do we, because a small
instruct model sampled at OpenAI's temperature 1 answers erratically where its authors' settings
answer sensibly. Keys the file leaves out (or sets to null) keep OpenAI's defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from engine.loading.json_file import read_json_object
from engine.types import CheckpointError, InvalidRequest, SamplingDefaults, SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's generation_config.json (None without one): its sampling defaults, and the
    eos ids an HF tokenizer reads from it."""
    return read_json_object(Path(checkpoint_dir) / GENERATION_CONFIG_FILE)


def read_sampling_defaults(checkpoint_dir: Path) -> SamplingDefaults:
    """The defaults of the checkpoint in `checkpoint_dir`; OpenAI's when it has no generation_config.json."""
    config = read_generation_config(checkpoint_dir)
    source = str(Path(checkpoint_dir) / GENERATION_CONFIG_FILE)
    return SamplingDefaults() if config is None else sampling_defaults_from(config, source=source)


def sampling_defaults_from(config: dict[str, Any], *, source: str) -> SamplingDefaults:
    """Pick the sampling keys out of a generation config; a value the sampler cannot use is refused
    naming the file and key, rather than failing every request later."""
    values: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{source}: {key} must be a number, got {value!r}")
        values[key] = max(int(value), 0) if key == "top_k" else float(value)  # HF and vLLM spell "off" 0 or -1
    defaults = SamplingDefaults(**values)
    try:
        SamplingParams(**dataclasses.asdict(defaults)).validate(vocab_size=0)
    except InvalidRequest as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    return defaults


def write_generation_config(checkpoint_dir: Path, defaults: SamplingDefaults) -> Path:
    """Write `defaults` (those that differ from OpenAI's) as the checkpoint's generation_config.json."""
    openai = SamplingDefaults()
    body = {key: getattr(defaults, key) for key in SAMPLING_KEYS if getattr(defaults, key) != getattr(openai, key)}
    path = Path(checkpoint_dir) / GENERATION_CONFIG_FILE
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps({**body, "do_sample": True}, indent=2) + "\n")
    os.replace(scratch, path)  # readers see the whole file or none
    return path
