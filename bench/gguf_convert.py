#!/usr/bin/env python3
"""Rewrite a GGUF's weights in another llama.cpp type, so llama-server can run on exactly the
values our engine computes with (a script of the bench suite; needs gguf and numpy, both
dependencies of llamaserve).

    python bench/gguf_convert.py IN.gguf OUT.gguf F32|BF16|Q8_0|Q4_0

- F32: every tensor dequantized to float32. From the demo's Q4_1 file this holds exactly the
  values `llamaserve import-gguf` produces, so a float32 engine and llama-server compute on
  identical weights.
- BF16: 2-D tensors dequantized then rounded to bfloat16, 1-D ones (norms) kept F32, the layout
  llama.cpp's own converter writes for a BF16 file.
- Q8_0, Q4_0: 2-D tensors requantized with gguf-py's quantizer (the same maths as llama.cpp's),
  1-D kept F32.
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
}


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, kind: str) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):  # the writer's, and ours below
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype, field.types[1] if vtype == GGUFValueType.ARRAY else None)
    writer.add_file_type(int(FILE_TYPES[kind]))


def _converted(values: np.ndarray, kind: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """(data, raw_dtype) to hand GGUFWriter.add_tensor; 1-D tensors stay F32 except in F32 itself."""
    if kind == "F32" or values.ndim < 2:
        return values, None
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
    started_s = time.monotonic()
    total_bytes = sum(int(t.n_elements) * 4 for t in reader.tensors)  # float32 values processed
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"{src.name} -> {kind}", disable=not (progress and sys.stderr.isatty()), file=sys.stderr) as bar:
        for tensor in reader.tensors:
            values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
            data, raw_dtype = _converted(values, kind)
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
