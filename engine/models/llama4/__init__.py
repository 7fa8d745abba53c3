"""Llama 4 text models (llama-models' llama4 reference): MoE feed-forward, NoPE layers, chunked
local attention, qk-norm, attention temperature tuning, Llama 4 RoPE scaling.

args.py: params.json rules and derived sizes; model.py: the layers, over the same backend
operations as engine/models/llama.py. Meta's shipped checkpoint keys: engine/loading/llama4.py.
"""
