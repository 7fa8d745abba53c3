"""Save and load a checkpoint shard holding quantized weights, without pickle.

The file is a safetensors file (https://huggingface.co/docs/safetensors: an 8-byte little-endian
header length, a JSON header, then the raw tensor bytes), written and read here without the
`safetensors` package. Our additions live in the header's `__metadata__` (a str -> str map), under
the key `llamaserve.quantization`: a JSON object {"version": 1, "weights": {KEY: header}} where
KEY is a weight's Meta name without ".weight" (e.g. "layers.0.attention.wq") and header is
QuantizedWeight.header() ({"format", "shape", "group_size"}). A quantized weight's tensors are
stored as `KEY.qweight`, `KEY.scales` and, for int4 with mins, `KEY.mins`; every other tensor
(norms, embeddings, output head) is stored under its own Meta name. docs/quantization.md has the
full description.

Loading maps the file copy-on-write (numpy memmap mode "c"): no tensor is copied until written.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from engine.quant import kquants
from engine.quant.formats import QuantizedWeight, from_tensors

METADATA_KEY = "llamaserve.quantization"
FORMAT_VERSION = 1
_ALIGN = 8  # the data section starts 8-byte aligned (safetensors pads the header with spaces)

# safetensors dtype names; numpy has no bfloat16 or float8, so those are read as same-size ints and viewed
_DTYPES: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.float32: ("F32", np.dtype(np.float32)),
    torch.float16: ("F16", np.dtype(np.float16)),
    torch.bfloat16: ("BF16", np.dtype(np.uint16)),
    torch.int8: ("I8", np.dtype(np.int8)),
    torch.uint8: ("U8", np.dtype(np.uint8)),
    torch.float8_e4m3fn: ("F8_E4M3", np.dtype(np.uint8)),
    torch.int32: ("I32", np.dtype(np.int32)),
    torch.int64: ("I64", np.dtype(np.int64)),
}
_BY_NAME = {name: (dtype, np_dtype) for dtype, (name, np_dtype) in _DTYPES.items()}


def save_shard(path: Path, quantized: dict[str, QuantizedWeight], plain: dict[str, torch.Tensor]) -> None:
    """Write `quantized` (by KEY, see the module docstring) and `plain` tensors to `path`, atomically."""
    tensors = dict(plain)
    for key, weight in quantized.items():
        for role, tensor in weight.tensors().items():
            tensors[f"{key}.{role}"] = tensor
    if len(tensors) != len(plain) + sum(len(w.tensors()) for w in quantized.values()):
        raise ValueError("a quantized weight's stored names collide with a plain tensor's")
    metadata = {METADATA_KEY: json.dumps({"version": FORMAT_VERSION, "weights": {k: w.header() for k, w in quantized.items()}})}
    _write(Path(path), tensors, metadata)


def load_shard(path: Path) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """(quantized weights by KEY, plain tensors by name) from a file save_shard wrote."""
    tensors, metadata = _read(Path(path))
    try:
        described = json.loads(metadata.get(METADATA_KEY, '{"version": 1, "weights": {}}'))
        if described.get("version") != FORMAT_VERSION:
            raise ValueError(f"quantization layout version {described.get('version')!r}, expected {FORMAT_VERSION}")
        quantized = {}
        for key, header in described["weights"].items():
            parts = {role: tensors.pop(f"{key}.{role}") for role in ("qweight", "scales", "mins") if f"{key}.{role}" in tensors}
            read = kquants.from_tensors if header.get("format") in kquants.K_FORMATS else from_tensors
            quantized[key] = read(header, parts)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: bad quantized-weight metadata: {exc}") from None
    return quantized, tensors


def read_formats(path: Path) -> set[str]:
    """The weight formats a shard declares (its header's metadata only; no tensor is mapped)."""
    header, _data_start = _read_header(Path(path))
    described = json.loads((header.get("__metadata__") or {}).get(METADATA_KEY, '{"weights": {}}'))
    return {str(weight.get("format")) for weight in described.get("weights", {}).values()}


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    # widest elements first, so every tensor starts aligned to its own element size (the format allows no gaps)
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype][0], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % _ALIGN)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            f.write(_raw_bytes(tensors[name]))
    os.replace(tmp, path)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _read_header(path: Path) -> tuple[dict, int]:
    """(the JSON header, where the data section starts) of a safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: truncated header")
        return json.loads(f.read(header_len)), 8 + header_len


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    size = path.stat().st_size
    header, data_start = _read_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c") if size > data_start else np.zeros(0, np.uint8)
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, entry in header.items():
        dtype, np_dtype = _BY_NAME[entry["dtype"]]
        begin, end = (data_start + int(o) for o in entry["data_offsets"])
        shape = [int(n) for n in entry["shape"]]
        if end > size or (end - begin) != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} does not fit its data_offsets")
        array = mapped[begin:end].view(np_dtype).reshape(shape)
        tensor = torch.from_numpy(array)
        tensors[name] = tensor.view(dtype) if dtype in (torch.bfloat16, torch.float8_e4m3fn) else tensor
    return tensors, metadata
