"""The request loop, plain Python above the model: what runs on rank 0 around each forward step.

async_engine.py (generate/abort per request; the loop on its own thread) -> engine_core.py (step =
schedule -> execute -> update) over scheduler.py (queues, token budget, chunked prefill, preemption)
and kv_blocks.py (block pool, prefix cache) on sequence.py's ints; output.py (one pass per step:
detokenizer.py, stop strings, finish reasons); sampler.py and structured.py (grammar masks) turn
logits into tokens. The executor (engine/executor/) is what engine_core drives.
"""
