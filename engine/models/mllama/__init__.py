"""Llama 3.2 Vision (11B, 90B; Llama Guard 3 Vision): llama-models' llama3/multimodal reference in
this engine's shape. args.py: sizes (the schedule from params.json, the encoder's from its weights);
vision.py: the tiled image encoder and projection; model.py: the text model with its cross-attention
layers and their per-sequence state; cache.py: one rank's states by sequence; engine/vision/mllama.py:
image tiling as the reference does it."""
