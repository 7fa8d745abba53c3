#!/usr/bin/env python3
"""Rewrite a GGUF's weights in another llama.cpp type, so llama-server can run on exactly the
values our engine computes with (a script of the bench suite; needs gguf and numpy, both
dependencies of llamaserve).

    python bench/gguf_convert.py IN.gguf OUT.gguf F32|BF16|Q8_0|Q4_0|Q4_K_M

- F32: every tensor dequantized to float32. From the demo's Q4_1 file this holds exactly the
  values `llamaserve import-gguf` produces, so a float32 engine and llama-server compute on
  identical weights.
- BF16: 2-D tensors dequantized then rounded to bfloat16, 1-D ones (norms) kept F32, the layout
  llama.cpp's own converter writes for a BF16 file.
- Q8_0, Q4_0: 2-D tensors requantized with gguf-py's quantizer (the same maths as llama.cpp's),
  1-D kept F32.
- Q4_K_M: llama.cpp's mix of that name (llama_tensor_get_type): Q6_K for the output head and for
  attn_v / ffn_down in the layers use_more_bits picks (the first and last eighth, every third
  between), Q4_K elsewhere, by engine.quant.kquants' round-to-nearest quantizers (not llama.cpp's
  error-minimizing search: other codes, the same block layout). A matrix whose rows are not whole
  256-value super-blocks (the demo's 576 columns) is Q8_0: llama.cpp falls back to Q5_0 there,
  which our engine does not keep quantized.
All metadata (architecture, tokenizer, chat template) is copied; general.file_type is set to match.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, kind: str) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):  # the writer's, and ours below
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype, field.types[1] if vtype == GGUFValueType.ARRAY else None)
    writer.add_file_type(int(FILE_TYPES[kind]))


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps at 6 bits."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _k_quant(values: np.ndarray, name: str, n_layers: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Q4_K_M's type for one matrix, and its blocks."""
    import torch

    from engine.quant.kquants import QK_K, quantize_q4_k, quantize_q6_k

    if values.shape[-1] % QK_K:
        return gguf.quants.quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    six_bits = name == "output.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n_layers))
    quantize, qtype = (quantize_q6_k, GGMLQuantizationType.Q6_K) if six_bits else (quantize_q4_k, GGMLQuantizationType.Q4_K)
    return quantize(torch.from_numpy(values.reshape(-1, values.shape[-1]))).qweight.numpy(), qtype


def _converted(values: np.ndarray, kind: str, name: str = "", n_layers: int = 0) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """(data, raw_dtype) to hand GGUFWriter.add_tensor; 1-D tensors stay F32 except in F32 itself."""
    if kind == "F32" or values.ndim < 2:
        return values, None
    if kind == "Q4_K_M":
        return _k_quant(values, name, n_layers)
    qtype = GGMLQuantizationType[kind]
    return gguf.quants.quantize(values, qtype), qtype


def convert(src: Path, dst: Path, kind: str, *, progress: bool = True) -> Path:
    """Write `dst` as `src` with its tensors in `kind` (see the module docstring)."""
    from tqdm import tqdm

    if kind not in FILE_TYPES:
        raise ValueError(f"unknown type {kind!r}; choose from {', '.join(FILE_TYPES)}")
    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer, kind)
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents()) if f"{arch}.block_count" in reader.fields else 0
    started_s = time.monotonic()
    total_bytes = sum(int(t.n_elements) * 4 for t in reader.tensors)  # float32 values processed
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"{src.name} -> {kind}", disable=not (progress and sys.stderr.isatty()), file=sys.stderr) as bar:
        for tensor in reader.tensors:
            values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
            data, raw_dtype = _converted(values, kind, tensor.name, n_layers)
            writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
            bar.update(values.size * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if not progress:
        return dst
    seconds = time.monotonic() - started_s
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB, {total_bytes / 2**20 / max(seconds, 1e-9):.0f} MiB/s of float32 values)",
          file=sys.stderr)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("kind", choices=sorted(FILE_TYPES))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    convert(args.src, args.dst, args.kind, progress=not args.quiet)
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
