"""README's architecture map names every source file of server/, compat/ and engine/ (a newcomer's
first map must not leave files out), and names no file that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".py", ".c", ".h"}


def architecture_rows() -> dict[str, set[str]]:
    """folder -> every backticked name in its row of the Architecture section's table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Architecture\n") : text.index("\n## ", text.index("## Architecture\n") + 1)]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = line.split("|")
        folder = re.fullmatch(r"\s*`([\w/]+/)`\s*", cells[1]) if len(cells) > 3 else None
        if folder:
            rows[folder.group(1)] = set(re.findall(r"`([^`]+)`", "|".join(cells[2:])))
    return rows


def source_files() -> list[Path]:
    return sorted(
        p.relative_to(ROOT)
        for package in ("server", "compat", "engine")
        for p in (ROOT / package).rglob("*")
        if p.suffix in SOURCE_SUFFIXES and p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def named_in(rows: dict[str, set[str]], path: Path) -> bool:
    """In its folder's row, or in an ancestor's row beside its subfolder's name (`llama4/`, `csrc/`)."""
    parts = path.parts
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:depth]) + "/"
        if folder in rows:
            names = rows[folder]
            sub = parts[depth:-1]
            return path.name in names and all(f"{s}/" in names for s in sub)
    return False


def test_the_map_has_a_row_per_package():
    rows = architecture_rows()
    assert {"server/", "compat/", "engine/", "engine/core/", "engine/executor/", "engine/models/"} <= set(rows)


@pytest.mark.parametrize("path", source_files(), ids=str)
def test_every_source_file_is_on_the_map(path):
    assert named_in(architecture_rows(), path), f"README's Architecture table does not name {path}"


def test_the_map_names_no_missing_file():
    rows = architecture_rows()
    existing = {p.name for p in source_files()}
    named = {n for names in rows.values() for n in names if re.fullmatch(r"[\w]+\.(py|c|h)", n)}
    assert named - existing - {"__init__.py"} == set()
