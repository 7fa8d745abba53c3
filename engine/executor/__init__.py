"""From a scheduled batch to sampled tokens, in vLLM's layers: executor.py's ModelExecutor (builds the
step's flat inputs, runs the worker group, samples) -> worker_group.py's WorkerGroup (rank 0's worker
plus model-parallel followers, one broadcast per step) -> worker.py's Worker (one rank: weights, KV
cache, forward). parallel.py is the process group and the followers' loop; step_inputs.py the only
thing broadcast.
"""
