"""Quantized linear weights: formats (formats.py), no-pickle shard files (shard_file.py), GGUF
blocks kept native (gguf_blocks.py; K-quant super-blocks: kquants.py), quantized weights with LoRA
adaptors (lora.py), CPU linears (linear.py, over the C kernels that engine/kernels/quant.py binds)
and CUDA linears (cuda.py).
docs/quantization.md describes the formats, the on-disk layout and the measured paths.

QUANTIZATION_TYPES maps the names a model is configured with (QUANTIZATION_TYPE, run.yaml,
metadata.quantization) to a weight format and its quantizer arguments; "mixed" means what
meta-reference means: the transformer's linears (wq, wk, wv, wo, w1, w2, w3) are quantized, while
embeddings, norms and the output head stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.quant.formats import INT4_GROUP_SIZE


@dataclass(frozen=True, slots=True)
class QuantizationType:
    format: str  # engine.quant.formats.FORMATS key
    group_size: int | None  # None: per row


QUANTIZATION_TYPES = {
    "fp8_mixed": QuantizationType("fp8", None),
    "int4_mixed": QuantizationType("int4", INT4_GROUP_SIZE),
    "int8": QuantizationType("int8", None),
}
