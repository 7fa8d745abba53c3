"""Where a model's checkpoint lives, and the rule that keeps API clients inside the checkpoint roots.

A `checkpoint_dir` sent to the API is untrusted: it must resolve (realpath, symlinks followed)
inside one of the checkpoint roots, may not contain `..`, and no symlink inside it may point out
of the roots (the loader's own guard, engine/loading/file_guard.py, checked here at registration). Directories named by the server's own config and env are trusted and may live
anywhere. Without a `checkpoint_dir` the checkpoint is looked up the way meta-reference did:
`<root>/<model_id>` in every root, then `<root>/<llama_model>` (`llama model download` names its
folders after descriptors).

An admin who keeps weights elsewhere and links them into a root adds the link's target as a root
too: a symlink leaving the roots is refused, whoever made it.

Errors are 400s whose message never says whether a path outside the roots exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from engine.loading import file_guard
from engine.loading.gguf_cache import is_gguf_file  # torch-free: a .gguf file is served directly
from server.errors import ApiError


def _error(message: str, code: str, param: str = "checkpoint_dir") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _check_relative_name(name: str, param: str) -> Path:
    """A name used under a root: relative, without `..`, without NUL."""
    if not name or "\x00" in name:
        raise _error(f"{param} must be a non-empty path", "invalid_checkpoint_dir", param)
    path = Path(name)
    if ".." in path.parts:
        raise _error(f"{param} {name!r} must not contain '..'", "checkpoint_dir_outside_roots", param)
    return path


def _check_links_inside(directory: Path, roots: list[Path]) -> None:
    """Refuse a dir whose files link out of the roots: the loader would refuse them (file_guard)."""
    try:
        file_guard.check_tree(directory, roots)
    except file_guard.OutsideRoots as exc:
        raise _error(f"checkpoint dir {directory.name!r} contains {exc.entry_name!r}, a symlink that leaves the "
                     "checkpoint roots", "checkpoint_dir_outside_roots") from None
    except file_guard.TooManyFiles:
        raise _error(f"checkpoint dir {directory.name!r} has too many files", "invalid_checkpoint_dir") from None


def _checked_untrusted(candidate: Path, real_roots: list[Path], shown: str) -> Path:
    """The realpath of an existing dir under the roots; `candidate` is absolute and lexically inside."""
    real = Path(os.path.realpath(candidate))
    if not file_guard.is_inside(real, real_roots):
        raise _error(
            f"checkpoint_dir {shown!r} resolves outside the checkpoint roots (symlink escape)",
            "checkpoint_dir_outside_roots",
        )
    if is_gguf_file(real):  # its real path is inside (above); the loader checks it again when it opens it
        return real
    if not real.is_dir():
        raise _error(f"checkpoint_dir {shown!r} is not a directory or a .gguf file", "checkpoint_not_found")
    _check_links_inside(real, real_roots)
    return real



def check_checkpoint_dir(requested: str | Path, roots: Sequence[Path], *, trusted: bool) -> Path:
    """The real path of an existing checkpoint dir (or .gguf file); a relative untrusted path is taken under each root."""
    shown = str(requested)
    if trusted:
        path = Path(os.path.realpath(Path(requested).expanduser()))
        if not path.is_dir() and not is_gguf_file(path):
            raise _error(f"checkpoint_dir {shown!r} does not exist or is not a directory or a .gguf file", "checkpoint_not_found")
        return path
    if not roots:
        raise _error(
            "this server has no checkpoint roots, so it accepts no checkpoint_dir",
            "checkpoint_dir_outside_roots",
        )
    path = _check_relative_name(shown, "checkpoint_dir")
    real_roots = file_guard.real_roots(roots)
    if path.is_absolute():
        lexical = Path(os.path.normpath(path))
        # Checked before existence, so that a client cannot probe paths outside the roots.
        lexical_roots = [Path(os.path.normpath(os.path.abspath(os.path.expanduser(r)))) for r in roots]
        if not file_guard.is_inside(lexical, lexical_roots + real_roots):
            raise _error(
                f"checkpoint_dir {shown!r} is outside the checkpoint roots ({_roots_text(roots)})",
                "checkpoint_dir_outside_roots",
            )
        candidates = [lexical]
    else:
        candidates = [root / path for root in real_roots]
    for candidate in candidates:
        if os.path.lexists(candidate):
            return _checked_untrusted(candidate, real_roots, shown)
    raise _error(f"checkpoint_dir {shown!r} does not exist under the checkpoint roots", "checkpoint_not_found")


def find_checkpoint_dir(
    names: Sequence[str], roots: Sequence[Path], *, trusted: bool, model_id: str
) -> Path:
    """Look for `<root>/<name>` for each name in order (model id first, then the descriptor), each root."""
    real_roots = file_guard.real_roots(roots)
    tried: list[str] = []
    for name in dict.fromkeys(n for n in names if n):
        if Path(name).is_absolute() or ".." in Path(name).parts or "\x00" in name:
            continue  # not a folder name; only an explicit checkpoint_dir may say where to look
        for root in real_roots:
            candidate = root / name
            tried.append(name)
            if not os.path.lexists(candidate):
                continue
            if trusted:
                real = Path(os.path.realpath(candidate))
                if real.is_dir():
                    return real
                continue
            return _checked_untrusted(candidate, real_roots, name)
    where = (f"{', '.join(dict.fromkeys(tried))} in the checkpoint roots" if tried
             else f"no usable folder name in the roots ({_roots_text(roots)})")
    raise _error(
        f"no checkpoint found for model {model_id!r}: looked for {where}; pass checkpoint_dir",
        "checkpoint_not_found",
    )


def _roots_text(roots: Sequence[Path]) -> str:
    return f"{len(roots)} configured" if roots else "none"


def shown_path(path: Path | str, roots: Sequence[Path]) -> str:
    """A checkpoint dir as clients see it: relative to the root it is in, else only its folder name,
    so that listings and errors never reveal the server's file system layout."""
    real = Path(os.path.realpath(path))
    for root in file_guard.real_roots(roots):
        if real.is_relative_to(root):
            return str(real.relative_to(root)) or "."
    return real.name


def redact_paths(text: str, paths: Sequence[Path | str], roots: Sequence[Path]) -> str:
    """`text` with every absolute path below `paths` and the roots replaced by its shown form."""
    prefixes = {str(p) for p in paths} | {str(os.path.realpath(p)) for p in paths}
    prefixes |= {str(r) for r in roots} | {str(r) for r in file_guard.real_roots(roots)}
    for prefix in sorted((p for p in prefixes if p not in ("", "/")), key=len, reverse=True):
        text = text.replace(prefix, shown_path(prefix, roots))
    return text
