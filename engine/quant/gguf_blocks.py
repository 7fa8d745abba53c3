"""GGUF Q4_0, Q4_1 and Q8_0 tensors kept as our int4 / int8 formats, with their exact block scales;
K-quants (Q4_K, Q5_K, Q6_K) kept in their own super-blocks (engine.quant.kquants).

A GGUF row of `cols` values is cols / 32 blocks (ggml's block size is 32 for all three types):
- Q4_0, 18 bytes: float16 d, 16 bytes of nibbles; value = d * (q - 8)      -> int4, no mins
- Q4_1, 20 bytes: float16 d, float16 m, 16 bytes of nibbles; value = d * q + m -> int4 with mins
- Q8_0, 34 bytes: float16 d, 32 int8; value = d * q                          -> int8, group 32
Inside a block, byte j holds column j (low nibble) and column j + 16 (high nibble): the packing
engine.quant.formats.Int4Weight uses, so the nibble bytes are copied as they are. Our dequantize()
then does the same float32 operations as `gguf.quants.dequantize`, so the values are bit for bit
equal (tests/engine/test_quant_gguf.py checks it), and our linears compute on llama.cpp's numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.quant import kquants
from engine.quant.formats import Int4Weight, Int8Weight, QuantizedWeight

_BLOCK = 32
# GGML type name -> (bytes per block, float16 header fields)
_LAYOUTS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1)}
NATIVE_TYPES = (*_LAYOUTS, *kquants.BY_GGML_TYPE)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Our weight from a GGUF tensor's raw block bytes (uint8; what gguf's reader gives as
    ReaderTensor.data) of type `type_name` and torch shape [rows, cols]. ValueError if the bytes
    do not match the type and shape."""
    if type_name not in _LAYOUTS:
        raise ValueError(f"GGUF type {type_name} is not kept native; these are: {', '.join(NATIVE_TYPES)}")
    rows, cols = shape
    type_size, halves = _LAYOUTS[type_name]
    if cols % _BLOCK or raw.dtype != np.uint8 or raw.size != rows * (cols // _BLOCK) * type_size:
        raise ValueError(
            f"{type_name} data of {raw.size} bytes ({raw.dtype}) does not hold a [{rows}, {cols}] tensor "
            f"({cols // _BLOCK if cols % _BLOCK == 0 else '?'} blocks of {type_size} bytes per row)"
        )
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // _BLOCK, type_size)
    half = 2 * halves
    scales = _f16(blocks[..., 0:2])
    payload = np.ascontiguousarray(blocks[..., half:]).reshape(rows, -1)
    if type_name == "Q8_0":
        return Int8Weight(torch.from_numpy(payload.view(np.int8).copy()), scales, _BLOCK)
    mins = _f16(blocks[..., 2:4]) if type_name == "Q4_1" else None
    return Int4Weight(torch.from_numpy(payload.copy()), scales, _BLOCK, mins, in_features_=cols)


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 2] little-endian bytes -> float16 [rows, blocks]."""
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].copy())


def from_reader_tensor(tensor) -> QuantizedWeight | None:
    """Our weight for a gguf ReaderTensor of a native type, else None (it is dequantized as before).
    GGUF shapes are ggml's (innermost first): [cols, rows]."""
    type_name = tensor.tensor_type.name
    if type_name not in NATIVE_TYPES or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)
    if type_name in kquants.BY_GGML_TYPE:  # a copy: GGUF data is a read-only mmap
        return kquants.from_gguf_blocks(torch.from_numpy(np.array(tensor.data, dtype=np.uint8)), type_name, (rows, cols))
    return from_gguf_blocks(np.asarray(tensor.data), type_name, (rows, cols))
