"""Checkpoint formats: one small reader per way a Llama checkpoint is shipped, detected from its files.

Every reader turns a folder into the same thing: model-parallel shards holding Meta's key names in
Meta's layout (q/k rows in Meta's rotary order), which engine/loading/checkpoint.py validates and
reshards to any model-parallel size by ParamLayout. The readers, in the order they are tried:

  meta       params.json + consolidated.NN.pth, one per model-parallel rank (consolidated.NN.safetensors:
             our quantized layout, engine/quant/shard_file.py); or torchtune's older meta_model_N.pt,
             or one loose *.pth / *.pt
  torchtune  torchtune's Meta-format checkpointer: epoch_N/model-0000K-of-0000M.bin (Meta keys,
             torch.save, split by key over M files) beside its copies of params.json and
             tokenizer.model. A torchtune output dir itself resolves to its latest epoch_N holding
             weights in any format (its HF checkpointer writes HF folders there; engine/loading/detect.py)
  hf         Hugging Face: config.json + model.safetensors, model-0000K-of-0000N.safetensors with
             model.safetensors.index.json, or pytorch_model*.bin (engine/loading/hf_checkpoint.py)

Adapter files (adapter_model.pt / .safetensors / .bin, torchtune's and PEFT's LoRA output; older
torchtune's adapter_N.pt) and optimizer state (recipe_state.pt) are never taken for weights; a folder holding only an adapter is
refused with a message saying how to serve it.

The reader interface (a new format is one class here or in its own module, and one entry in
engine/loading/detect.py's READERS):

    name: str
        stored in CheckpointSpec.format; picks the reader again in each model-parallel worker.
    find(folder: Path) -> Found | None
        None when the folder is not in this format; reads no weights, only names and small JSON.
        Raises CheckpointError naming the file and what is missing when it is this format but broken.
    read_shard(path: Path, args: ModelArgs, allowed_roots: tuple[Path, ...]) -> dict[str, Tensor | QuantizedWeight]
        The whole of the shard `path` (one of Found.shard_paths) under Meta names, mapped lazily
        (mmap) where the file format allows. Every other file it opens goes through
        file_guard.guarded(file, allowed_roots).

    Found.folder        the folder params.json, tokenizer and generation_config.json are read from
                        (a torchtune output dir resolves to an epoch folder)
    Found.shard_paths   one path per model-parallel shard, in rank order; a format that splits one
                        shard's keys over several files gives one path (its index or first file)
                        and its read_shard finds the siblings
    Found.params        params.json fields read from another file (HF config.json); None: the
                        folder's params.json, or the descriptor's published architecture
    Found.params_source the file `params` came from, for error messages

Plugging in another format (Meta's FP8 / int4 releases, GGUF): a reader class whose find() spots its
files (fp8_scales_N.pt beside consolidated.NN.pth; a .gguf) and whose read_shard() returns Meta names
with engine.quant QuantizedWeight values where the weights stay quantized, listed in
engine/loading/detect.py's readers() ahead of MetaReader when it must win over it. The loader's
validation, resharding (QuantizedWeight.rows/cols) and the workers need nothing else. A checkpoint
named by a single file rather than a folder also needs resolve_checkpoint's is_dir check relaxed.
"""

from __future__ import annotations

import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.loading.file_guard import guarded
from engine.types import CheckpointError

if TYPE_CHECKING:
    from engine.models.args import ModelArgs

log = logging.getLogger(__name__)

PARAMS_FILE = "params.json"
# LoRA adapters: PEFT's and torchtune's adapter_model.*, older torchtune's adapter_N.pt. Never weights:
# they are served on their base model.
_ADAPTER = re.compile(r"^adapter_(model|\d+)\.(pt|pth|bin|safetensors)$")
_OPTIMIZER_STATE = "recipe_state.pt"  # torchtune's, beside the weights of a resumable run


def is_adapter_file(name: str) -> bool:
    return _ADAPTER.match(name) is not None

_CONSOLIDATED = re.compile(r"^consolidated\.(\d+)\.pth$")
_CONSOLIDATED_QUANTIZED = re.compile(r"^consolidated\.(\d+)\.safetensors$")  # our no-pickle quantized layout
_TORCHTUNE_OLD = re.compile(r"^meta_model_(\d+)\.pth?$")  # older torchtune: one file per epoch, side by side
_TORCHTUNE_FILE = re.compile(r"^model-(\d+)-of-(\d+)\.bin$")  # torchtune's Meta checkpointer, split by key
_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")


@dataclass(frozen=True, slots=True)
class Found:
    format: str
    folder: Path
    shard_paths: tuple[Path, ...]  # [K] model-parallel shards, rank order
    params: dict[str, Any] | None = None
    params_source: Path | None = None


class CheckpointReader(Protocol):
    name: str

    def find(self, folder: Path) -> Found | None: ...

    def read_shard(self, path: Path, args: ModelArgs, allowed_roots: tuple[Path, ...]) -> dict[str, Any]: ...


def list_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


# --------------------------------------------------------------------------- torch files
def torch_load(path: Path) -> dict[str, Any]:
    """A torch.save file's tensors, mmapped; anything but tensors is refused (weights_only)."""
    import torch

    if not path.is_file():
        raise CheckpointError(f"{path}: weight shard is missing")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # Pre-zipfile torch.save format: no mmap, still weights_only.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load: the file holds objects other than tensors ({first})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    if "model" in state and isinstance(state["model"], dict):  # torchtune wraps some outputs in {"model": ...}
        state = state["model"]
    return state


def safetensors_load(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors, mapped copy-on-write (engine/quant/shard_file.py's reader, which
    also turns our quantized layout's weights into engine.quant weights under `KEY.weight`)."""
    import json
    import struct

    from engine.quant.shard_file import load_shard

    if not path.is_file():
        raise CheckpointError(f"{path}: weight shard is missing")
    try:
        quantized, plain = load_shard(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    return {**plain, **{f"{key}.weight": weight for key, weight in quantized.items()}}


# --------------------------------------------------------------------------- meta
class MetaReader:
    """consolidated.NN.pth in rank order; else consolidated.NN.safetensors; else torchtune's older
    meta_model_N.pt (the latest epoch); else one loose *.pth / *.pt that is not an adapter."""

    name = "meta"

    def find(self, folder: Path) -> Found | None:
        files = list_files(folder)
        numbered = sorted((int(m.group(1)), p) for p in files if (m := _CONSOLIDATED.match(p.name)))
        numbered = numbered or sorted((int(m.group(1)), p) for p in files if (m := _CONSOLIDATED_QUANTIZED.match(p.name)))
        if numbered:
            ranks = [rank for rank, _ in numbered]
            if ranks != list(range(len(ranks))):
                raise CheckpointError(f"{folder}: consolidated shards are not numbered 00..{len(ranks) - 1:02d}: {ranks}")
            return Found(self.name, folder, tuple(p for _, p in numbered))
        tune = sorted((int(m.group(1)), p) for p in files if (m := _TORCHTUNE_OLD.match(p.name)))
        if tune:
            if len(tune) > 1:
                log.info("%s: %d torchtune epoch checkpoints, using the latest, %s", folder, len(tune), tune[-1][1].name)
            return Found(self.name, folder, (tune[-1][1],))
        loose = [p for p in files if p.suffix in (".pth", ".pt") and not is_adapter_file(p.name) and p.name != _OPTIMIZER_STATE]
        if len(loose) == 1:
            return Found(self.name, folder, (loose[0],))
        return None

    def read_shard(self, path: Path, args: ModelArgs, allowed_roots: tuple[Path, ...]) -> dict[str, Any]:
        return safetensors_load(path) if path.suffix == ".safetensors" else torch_load(path)


# --------------------------------------------------------------------------- torchtune
def numbered_set(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    """model-0000K-of-0000M files of one set, K = 1..M; CheckpointError naming a missing one."""
    matches = [(int(m.group(1)), int(m.group(2)), p) for p in list_files(folder) if (m := pattern.match(p.name))]
    if not matches:
        return []
    totals = {total for _, total, _ in matches}
    if len(totals) > 1:
        raise CheckpointError(f"{folder}: weight files from different sets ({sorted(p.name for _, _, p in matches)[:4]})")
    (total,) = totals
    by_index = {index: p for index, _, p in matches}
    width = len(matches[0][2].name.split("-")[1])
    for index in range(1, total + 1):
        if index not in by_index:
            name = matches[0][2].name.replace(matches[0][2].name.split("-")[1], f"{index:0{width}d}", 1)
            raise CheckpointError(f"{folder / name}: missing ({total} weight files expected, {len(by_index)} found)")
    return [by_index[i] for i in range(1, total + 1)]


def epoch_folders(folder: Path) -> list[Path]:
    """torchtune's epoch_N subfolders of an output dir, oldest first (engine/loading/detect.py picks
    the latest that holds weights, in whichever format the checkpointer wrote)."""
    epochs = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _EPOCH_DIR.match(p.name)))
    return [p for _, p in epochs]


class TorchtuneReader:
    """epoch_N/model-0000K-of-0000M.bin with Meta keys (torchtune's FullModelMetaCheckpointer)."""

    name = "torchtune"

    def find(self, folder: Path) -> Found | None:
        files = numbered_set(folder, _TORCHTUNE_FILE)
        if not files:
            return None
        return Found(self.name, folder, (files[0],))

    def read_shard(self, path: Path, args: ModelArgs, allowed_roots: tuple[Path, ...]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for file in numbered_set(path.parent, _TORCHTUNE_FILE):
            part = torch_load(guarded(file, allowed_roots))
            repeated = next((key for key in part if key in state), None)
            if repeated is not None:
                raise CheckpointError(f"{file}: key {repeated!r} is also in an earlier file of the set")
            state.update(part)
        return state


def architecture_file(found_format: str) -> str:
    """The file a format states its architecture in, for error messages."""
    return "config.json" if found_format == "hf" else PARAMS_FILE


__all__ = [
    "CheckpointReader",
    "Found",
    "MetaReader",
    "TorchtuneReader",
    "architecture_file",
    "epoch_folders",
    "is_adapter_file",
    "list_files",
    "numbered_set",
    "safetensors_load",
    "torch_load",
]
