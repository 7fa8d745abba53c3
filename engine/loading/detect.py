"""Which checkpoint format a folder holds: the readers in the order they are tried.

The reader interface is in engine/loading/formats.py's docstring; a new format is one entry in
`readers()`. Resolution (engine/loading/checkpoint.py) calls detect_format once per folder; each
model-parallel worker finds its reader again by name (reader_for), so nothing but the format's
name travels in a CheckpointSpec.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.loading.formats import CheckpointReader, Found, MetaReader, TorchtuneReader, epoch_folders, is_adapter_file, list_files
from engine.loading.hf_checkpoint import HFReader
from engine.types import CheckpointError

log = logging.getLogger(__name__)


def readers() -> tuple[CheckpointReader, ...]:
    """Every reader, most specific first: Meta's own layout wins over the others when both are present."""
    return (MetaReader(), TorchtuneReader(), HFReader())


def reader_for(name: str) -> CheckpointReader:
    """The reader a CheckpointSpec was resolved with (its `format`)."""
    for reader in readers():
        if reader.name == name:
            return reader
    raise CheckpointError(f"unknown checkpoint format {name!r}")


def _find(folder: Path) -> Found | None:
    for reader in readers():
        found = reader.find(folder)
        if found is not None:
            return found
    return None


def detect_format(folder: Path) -> Found:
    """The first reader that recognises `folder`, or for a torchtune output dir its latest epoch_N
    that one recognises (logged); CheckpointError saying what was looked for otherwise."""
    found = _find(folder)
    if found is not None:
        return found
    epochs = [(epoch, found) for epoch in epoch_folders(folder) if (found := _find(epoch)) is not None]
    if epochs:
        epoch, found = epochs[-1]
        log.info("%s: torchtune output with %s; serving the latest, %s", folder, ", ".join(e.name for e, _ in epochs), epoch.name)
        return found
    present = [p.name for p in list_files(folder)]
    latest = epoch_folders(folder)[-1:]  # a torchtune run that saved only its adapter
    adapters = [folder / name for name in present if is_adapter_file(name)]
    adapters += [p for epoch in latest for p in list_files(epoch) if is_adapter_file(p.name)]
    if adapters:
        raise CheckpointError(
            f"{adapters[0]}: this folder holds a LoRA adapter, not a model's weights; serve it on its base "
            "model: register the base model, then register this folder with metadata {\"base_model\": \"<base model "
            "id>\"} (or merge the adapter into the base weights first)"
        )
    listed = ", ".join(present + [p.name + "/" for p in sorted(folder.iterdir()) if p.is_dir()]) or "nothing"
    raise CheckpointError(
        f"{folder}: no model weights found (found {listed}); expected Meta's consolidated.NN.pth, torchtune's "
        "epoch_N/model-0000K-of-0000M.bin, or Hugging Face config.json with model*.safetensors / pytorch_model*.bin"
    )


__all__ = ["detect_format", "reader_for", "readers"]
