"""The checkpoint-root guard: a checkpoint from an untrusted source may only be read inside the
checkpoint roots. The server applies it when a model is registered (server/paths.py, which words
its refusals as API errors) and the loader again as files are opened: each file's real path is
checked when it is opened, not only when the model was registered, so a symlink swapped in later
cannot make the loader read outside the roots. Empty roots mean a trusted dir (named by the
operator): no check.

This module imports neither torch nor numpy: the server imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from engine.types import CheckpointError

MAX_TREE_DEPTH = 3  # checkpoint dirs are flat (Meta) or one level deep (HF original/)
MAX_TREE_ENTRIES = 10_000


class OutsideRoots(CheckpointError):
    """A file or dir of the checkpoint resolves outside the checkpoint roots."""

    def __init__(self, message: str, *, entry_name: str) -> None:
        super().__init__(message)
        self.entry_name = entry_name


class TooManyFiles(CheckpointError):
    """The checkpoint dir holds more than MAX_TREE_ENTRIES entries (a bound on the scan)."""


def real_roots(roots: Sequence[Path | str]) -> list[Path]:
    return [Path(os.path.realpath(os.path.expanduser(root))) for root in roots]


def is_inside(path: Path, roots: Iterable[Path]) -> bool:
    """`path` is one of `roots` or below one (compare real paths with real roots, lexical with lexical)."""
    return any(path == root or path.is_relative_to(root) for root in roots)


def guarded(path: Path, roots: Sequence[Path]) -> Path:
    """`path` if its real path lies inside one of `roots` (or roots is empty); else OutsideRoots."""
    if roots and not is_inside(Path(os.path.realpath(path)), real_roots(roots)):
        name = Path(path).name
        raise OutsideRoots(f"{name}: resolves outside the checkpoint roots; refusing to read it", entry_name=name)
    return path


def guard_tree(directory: Path, roots: Sequence[Path]) -> None:
    """`directory` and everything under it resolve inside `roots` (or roots is empty)."""
    if roots:
        guarded(directory, roots)
        check_tree(directory, real_roots(roots))


def check_tree(directory: Path, roots: list[Path]) -> None:
    """Every entry under `directory` (whose real path is inside the real `roots`), symlinked dirs
    followed, MAX_TREE_DEPTH deep, resolves inside them: OutsideRoots naming the first that does
    not, TooManyFiles past MAX_TREE_ENTRIES. Only links need resolving: any other entry lies in
    its parent's real dir, which is inside."""
    seen = 0
    pending: list[tuple[str, int]] = [(str(directory), 0)]
    while pending:
        current, depth = pending.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_TREE_ENTRIES:
                    raise TooManyFiles(f"{Path(directory).name}: too many files in the checkpoint dir")
                if entry.is_symlink() and not is_inside(Path(os.path.realpath(entry.path)), roots):
                    raise OutsideRoots(f"{entry.name}: resolves outside the checkpoint roots; refusing the checkpoint",
                                       entry_name=entry.name)
                if entry.is_dir() and depth + 1 < MAX_TREE_DEPTH:  # follows links to dirs (checked just above)
                    pending.append((entry.path, depth + 1))
