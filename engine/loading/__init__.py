"""Checkpoints in, model args and weights out: formats (checkpoint.py: Meta shards, resharding;
llama4.py: Llama 4's shipped keys), descriptors, the checkpoint-root guard, generation defaults, load
progress, and the offline steps (gguf_import.py, demo.py) that run before serving.
"""
