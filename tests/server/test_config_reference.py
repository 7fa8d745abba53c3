"""README's configuration reference is generated from the code (server/config_docs.py); these
tests fail when a flag, env variable or run.yaml key changes and the README was not regenerated."""

from __future__ import annotations

import re
from pathlib import Path

from server import config_docs
from server.__main__ import make_parser
from server.config import OPTIONS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SOURCES = "\n".join(p.read_text() for d in ("server", "engine") for p in (REPO / d).rglob("*.py"))


def test_readme_block_is_the_generated_one():
    start, end = README.index(config_docs.START), README.index(config_docs.END) + len(config_docs.END)
    assert README[start:end] == config_docs.block(), "regenerate it: python -m server.config_docs --write README.md"


def test_every_flag_and_option_has_a_row():
    table = config_docs.reference_table()
    flags = {f for a in make_parser()._actions for f in a.option_strings if f.startswith("--") and f != "--help"}
    for flag in flags:
        assert f"`{flag}" in table or f"/ `{flag}`" in table, flag
    for option in OPTIONS:
        assert f"`{option.section}.{option.name}`" in table


def test_every_environment_variable_the_readme_names_is_read_by_the_code():
    named = set(re.findall(r"\b((?:LLAMASERVE|INFERENCE)_[A-Z_]+)\b", README)) | set(re.findall(r"\b(MODEL_PARALLEL_SIZE|QUANTIZATION_TYPE|MAX_BATCH_SIZE|MAX_SEQ_LEN|LLAMA_MODELS_DEBUG)\b", README))
    derived = {"LLAMASERVE_" + o.name.upper() for o in OPTIONS} | {"LLAMASERVE_" + n for n in ("CONFIG", "MODEL", "CHECKPOINT_DIR", "LLAMA_MODEL")}
    for name in sorted(named):
        suffix = name.removeprefix("LLAMASERVE_")
        assert name in derived or f'"{name}"' in SOURCES or f'"{suffix}"' in SOURCES, f"{name} is not read anywhere"
