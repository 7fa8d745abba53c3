"""A `.gguf` file served as it is: registered as `checkpoint_dir` (the API, INFERENCE_CHECKPOINT_DIR,
run.yaml), it is converted once by engine.loading.gguf_import, with its quantized blocks kept
(Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K; other types dequantized), into
`<cache dir>/gguf/<file stem>-<key>/`, and later loads use that conversion.

The key is a sha256 over the file's real path, its size, its modification time (ns) and the
converter's version, not over its contents: hashing a 40 GB file would cost minutes at every start,
while a file replaced, rewritten or touched changes its size or mtime and converts again (a copy at
another path converts once more, too). The checkpoint-root guard (engine/loading/file_guard.py)
applies to the file: an untrusted registration's GGUF must resolve inside the checkpoint roots when
it is opened. The conversion is our own output under our cache dir, so it is read unguarded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from engine.loading.demo import cache_lock, default_cache_dir
from engine.loading.file_guard import guarded
from engine.loading.progress import ProgressCallback
from engine.types import CheckpointError

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
CONVERSION_VERSION = 1  # bump when the importer's output changes, so old conversions are redone
_MARKER = ".llamaserve-gguf.json"  # written last: its presence means the conversion finished


def is_gguf_file(path: Path | str) -> bool:
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def cache_key(gguf_path: Path) -> str:
    """sha256 (first 16 hex digits) of the real path, size, mtime and CONVERSION_VERSION."""
    real = Path(os.path.realpath(gguf_path))
    stat = real.stat()
    text = json.dumps([str(real), stat.st_size, stat.st_mtime_ns, CONVERSION_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def converted_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where `gguf_path`'s conversion lives (whether or not it exists yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{Path(gguf_path).stem}-{cache_key(gguf_path)}"


def is_converted(checkpoint_dir: Path) -> bool:
    try:
        marker = json.loads((checkpoint_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION and (checkpoint_dir / "params.json").is_file()


def gguf_params(gguf_path: Path, allowed_roots: Sequence[Path] = ()) -> dict[str, Any]:
    """params.json's fields from the file's header (for a memory estimate before converting)."""
    from engine.loading.gguf_import import read_gguf_params

    return read_gguf_params(guarded(Path(gguf_path), allowed_roots))


def ensure_converted(gguf_path: Path, *, allowed_roots: Sequence[Path] = (), cache_dir: Path | None = None,
                     progress: ProgressCallback | None = None) -> Path:
    """The checkpoint dir converted from `gguf_path`, converting it first if no finished conversion
    of this file (same path, size, mtime) is cached. One process converts at a time; the others
    wait, then use its result. CheckpointError for an unreadable file or an unwritable cache."""
    from engine.loading.gguf_import import import_gguf

    source = Path(os.path.realpath(guarded(Path(gguf_path), allowed_roots)))  # opened by this name below
    if not source.is_file():
        raise CheckpointError(f"{Path(gguf_path).name}: GGUF file does not exist")
    target = converted_dir(source, cache_dir)
    if is_converted(target):
        log.info("%s: using its conversion cached in %s", source.name, target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the GGUF cache dir {target.parent}: {exc}") from None
    with cache_lock(target.parent / ".gguf.lock"):
        if is_converted(target):  # another process finished it while this one waited
            return target
        for stale in target.parent.glob(f".{target.name}.*"):  # scratch dirs of a conversion that was killed
            shutil.rmtree(stale, ignore_errors=True)
        log.info("%s: converting once into %s (its quantized blocks kept)", source.name, target)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            out = import_gguf(source, scratch / "checkpoint", progress=False, keep_quantized=True, callback=progress)
            marker = {"version": CONVERSION_VERSION, "source": str(source), "size": source.stat().st_size}
            (out / _MARKER).write_text(json.dumps(marker, indent=2))
            if target.exists():  # an older or interrupted conversion
                shutil.rmtree(target)
            os.replace(out, target)
        except OSError as exc:
            raise CheckpointError(f"cannot write the conversion of {source.name} into {target}: {exc}") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


__all__ = ["GGUF_SUFFIX", "cache_key", "converted_dir", "ensure_converted", "gguf_params", "is_converted", "is_gguf_file"]
