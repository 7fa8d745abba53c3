"""Resident memory of the demo model loaded the server's way (a script, not a test): the demo
checkpoint (float32 by default, as `python -m server --demo` loads it) built by WorkerGroup with
the server's EngineConfig defaults, then RSS (after malloc_trim(0)) and the model's weight_bytes
(the loaded-bytes figure the engine reports). Run it from two checkouts to compare them:

    PYTHONPATH=$PWD python bench/load_rss.py [--weights float32|native] [--dtype float32] [--checkpoint DIR]

--checkpoint: another Meta-format checkpoint instead of the demo (the smoke run's tiny one).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import rss_mib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="float32", help="the demo's --demo-weights")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--checkpoint", type=Path, help="a Meta-format checkpoint dir instead of the demo")
    opts = parser.parse_args()
    import torch

    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.loading.demo import ensure_demo_checkpoint

    before_mib = rss_mib()
    if opts.checkpoint is not None:
        spec = resolve_checkpoint(opts.checkpoint, model_id=opts.checkpoint.name)
    else:
        demo = ensure_demo_checkpoint(None, weights=opts.weights)
        spec = resolve_checkpoint(Path(demo.checkpoint_dir), model_id=demo.model_id, llama_model=getattr(demo, "llama_model", None))
    started_s = time.perf_counter()
    workers = WorkerGroup(spec, EngineConfig(dtype=opts.dtype), max_seq_len=2048)
    load_s = time.perf_counter() - started_s
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(json.dumps({"weights": str(opts.checkpoint or opts.weights), "dtype": opts.dtype, "torch_threads": torch.get_num_threads(), "load_s": round(load_s, 1),
                      "rss_before_mib": round(before_mib), "rss_after_load_mib": round(rss_mib()),
                      "weight_bytes_mib": round(workers.weight_bytes / 2**20, 1)}), flush=True)  # fmt: skip
    workers.shutdown()


if __name__ == "__main__":
    main()
