"""What the bench scripts share: the model configs and one results format.

Configs: 'tiny' and 'small' random Llama 3 shapes (the real 128256-token vocabulary, so the output
head costs what it costs in serving), and 'demo' (the demo model's shape); bench/forward.py and bench/throughput.py both take them by name.

Results: every script prints its figures and, with `--json PATH`, writes one file in this shape:

    {"bench": "forward", "version": 1, "started": "2026-12-03T17:40:00Z", "argv": [...],
     "machine": {"cpu": ..., "cores": 2, "torch": ..., "threads": 2,
                 "load_average_before": [...], "load_average_after": [...]},
     "rows": [{"name": "decode", "config": "tiny", "dtype": "float32", "batch": 8,
               "value": 812.3, "unit": "tok/s", "bound": 1650.0, "of_bound": 0.49}, ...]}

A row is a flat dict: `name`, `value` and `unit` always; the rest are the row's coordinates and
context (config, dtype, batch, concurrency, ...). Flat rows diff and plot without a schema.
This module imports neither torch nor the engine at import time, so bench/serve.py (a pure HTTP
client) can use it on a machine without them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_VERSION = 1

# params.json fields of each config (engine.models.args.ModelArgs takes them verbatim)
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.3),
    "small": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.3),
    # the demo model's shape (SmolLM2-135M-Instruct: FFN 1536, tied output head), random weights
    "demo": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, multiple_of=256, rope_theta=100000.0, tie_word_embeddings=True),
    # ../shared/peers/make_big_gguf.py's 1.1B Llama (FFN 8192, tied head), random weights
    "big1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=49152, multiple_of=4096, rope_theta=100000.0, tie_word_embeddings=True),
    # Llama 3 8B's shape (Meta's params.json: FFN 14336, 128K vocab, untied head), random weights: 16 GB in bf16
    "llama3_8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0),
}


def model_args(config_name: str):
    """engine.models.args.ModelArgs of a named config (imports torch)."""
    from engine.models.args import ModelArgs

    if config_name not in CONFIGS:
        raise SystemExit(f"unknown config {config_name!r}; choose from {', '.join(CONFIGS)}")
    return ModelArgs(**CONFIGS[config_name])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB; 0 where /proc has none."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Results:
    """Rows collected by one bench run, written as JSON with the machine they ran on."""

    bench: str
    context: dict[str, Any] = field(default_factory=dict)  # added to every row (e.g. the config)
    rows: list[dict[str, Any]] = field(default_factory=list)
    started: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    load_average_before: list[float] = field(default_factory=load_average)

    def add(self, name: str, value: float, unit: str, **context: Any) -> dict[str, Any]:
        row = {"name": name, "value": value, "unit": unit, **self.context, **context}
        self.rows.append(row)
        return row

    def to_dict(self, **machine: Any) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "version": RESULTS_VERSION,
            "started": self.started,
            "argv": sys.argv[1:],
            "machine": {
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_before": self.load_average_before,
                "load_average_after": load_average(),
                **machine,
            },
            "rows": self.rows,
        }

    def write(self, path: str | Path | None, **machine: Any) -> None:
        """Write the JSON file (no-op without a path); `machine` adds e.g. torch version, threads."""
        if not path:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(**machine), indent=2) + "\n")
        print(f"results written to {path}", flush=True)



def kernel_builds(baseline: "Path | None") -> dict:
    """{"ours": this tree's cpu_kernels build, "baseline": another build's .so (older code, another
    ISA level) when given}: the kernel A/B scripts' libraries. Exits where nothing can be built."""
    import ctypes

    from engine.kernels.cpu import CpuKernels, load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C kernels could not be built here")
    libs = {"ours": kernels}
    if baseline:
        libs["baseline"] = CpuKernels(ctypes.CDLL(str(baseline)), partial=True)
    return libs

def torch_machine() -> dict[str, Any]:
    """The torch side of the machine record (for the scripts that run the engine in-process)."""
    import torch

    return {"torch": torch.__version__, "threads": torch.get_num_threads()}


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (format: bench/common.py)")


def read_results(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if data.get("version") != RESULTS_VERSION or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a bench results file of version {RESULTS_VERSION}")
    return data
