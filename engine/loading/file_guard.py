"""Checkpoint files opened only where the server allows: each file's real path is checked when it is
opened, not only when the model was registered, so a symlink swapped in later (or one inside a
symlinked directory, which the registration scan does not enter) cannot make the loader read
outside the checkpoint roots. Empty roots mean a trusted dir (named by the operator): no check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from engine.types import CheckpointError

MAX_TREE_DEPTH = 3  # checkpoint dirs are flat (Meta) or one level deep (HF original/)
MAX_TREE_ENTRIES = 10_000


def _inside(real: str, real_roots: Sequence[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in real_roots)


def guarded(path: Path, roots: Sequence[Path]) -> Path:
    """`path` if its real path lies inside one of `roots` (or roots is empty); else CheckpointError."""
    if not roots:
        return path
    real_roots = [os.path.realpath(root) for root in roots]
    if not _inside(os.path.realpath(path), real_roots):
        raise CheckpointError(f"{Path(path).name}: resolves outside the checkpoint roots; refusing to read it")
    return path


def guard_tree(directory: Path, roots: Sequence[Path]) -> None:
    """Every file and dir under `directory`, symlinked dirs followed, resolves inside `roots`."""
    if not roots:
        return
    real_roots = [os.path.realpath(root) for root in roots]
    guarded(directory, roots)
    seen = 0
    pending: list[tuple[str, int]] = [(str(directory), 0)]
    while pending:
        current, depth = pending.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_TREE_ENTRIES:
                    raise CheckpointError(f"{Path(directory).name}: too many files in the checkpoint dir")
                if not _inside(os.path.realpath(entry.path), real_roots):
                    raise CheckpointError(f"{entry.name}: resolves outside the checkpoint roots; refusing the "
                                          "checkpoint")
                if entry.is_dir() and depth + 1 < MAX_TREE_DEPTH:  # follows symlinked dirs, unlike registration
                    pending.append((entry.path, depth + 1))
