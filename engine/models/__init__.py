"""The models: Llama 2 / 3 (llama.py), Llama 4 (llama4/) and Llama 3.2 Vision (mllama/), over the backend operations
(engine/backends/), with their architecture (args.py: params.json) beside them. The loader
(engine/loading/) imports these, never the reverse."""

from __future__ import annotations

from engine.models.args import ModelArgs
from engine.models.llama import Transformer
from engine.models.llama4.model import Llama4Transformer
from engine.models.mllama.model import MllamaTransformer

MODEL_CLASSES: dict[str, type[Transformer]] = {"llama": Transformer, "llama4": Llama4Transformer, "mllama": MllamaTransformer}


def model_class(args: ModelArgs) -> type[Transformer]:
    """The model for a checkpoint's architecture (ModelArgs.architecture)."""
    return MODEL_CLASSES[args.architecture]
