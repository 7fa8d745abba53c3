"""`python -m server` / `llamaserve`: parse flags, merge the config, run the app until SIGTERM.

    llamaserve --model Llama3.2-1B-Instruct --checkpoint-dir ~/.llama/checkpoints/Llama3.2-1B-Instruct
    llamaserve --config run.yaml --api-key "$KEY"
    llamaserve --demo
    llamaserve import-gguf model.gguf OUT_DIR

The engine (torch) is imported here, lazily, and nowhere else in server/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

from server.config import ConfigError, ServerConfig, add_arguments, build_config


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamaserve",
        description="An OpenAI-compatible inference server for Meta-format Llama checkpoints. Every flag can "
        "also be set as LLAMASERVE_<FLAG> (e.g. LLAMASERVE_PORT) or in run.yaml; flags win over env, env over "
        "run.yaml. Subcommand: 'llamaserve import-gguf FILE OUT_DIR' converts a GGUF file to a Meta checkpoint.",
    )
    add_arguments(parser)
    return parser


# libgomp (torch's OpenMP) spins ~300k rounds at every barrier of the ~150 parallel regions of a
# step; when other work shares the cores a spinner burns the time slice its partner needs: a demo
# 8-stream run took 74 s instead of 7 s on a busy 2-core machine (bench/NOTES.md). A shorter spin
# still covers the barriers of a quiet machine. Set before torch loads; a user's choice wins.
OMP_SPIN_ENV = ("GOMP_SPINCOUNT", "100000")


def main(argv: Sequence[str] | None = None) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault(*OMP_SPIN_ENV)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "import-gguf":
        from engine.loading.gguf_import import main as import_gguf

        return import_gguf(argv[1:])
    args = make_parser().parse_args(argv)
    from server.logging import configure_logging

    try:
        config = build_config(args)
        configure_logging(config.log_format, config.log_level)  # before the demo's first download and conversion log their progress
        if config.demo:
            config = with_demo_model(config)
        config = with_batch_dir(config)
    except ConfigError as exc:
        print(f"llamaserve: configuration error: {exc}", file=sys.stderr)
        return 2
    if torchrun_follower_rank() is not None:
        return follow(config)
    serve(config)
    return 0


def torchrun_follower_rank() -> int | None:
    """Under `torchrun --nproc-per-node N -m server ...` every rank runs this command; ranks > 0
    run the model-parallel follower loop instead of the HTTP server."""
    rank = os.environ.get("RANK")
    if rank is None or "WORLD_SIZE" not in os.environ or not rank.isdigit() or int(rank) == 0:
        return None
    return int(rank)


def follow(config: ServerConfig) -> int:
    if len(config.models) != 1:
        print("llamaserve: under torchrun, configure exactly one model (every rank loads its shard of it)",
              file=sys.stderr)
        return 2
    from engine.loader import follow_torchrun  # resolves the checkpoint as rank 0 does, then workers.follow

    follow_torchrun(config.models[0], config.engine)
    return 0


def with_demo_model(config: ServerConfig) -> ServerConfig:
    """--demo: add the demo checkpoint (downloaded or built once) to the configured models."""
    from engine.types import CheckpointError
    from server.model_spec import ModelSpec

    try:
        from engine.loading.demo import ensure_demo_checkpoint
    except ImportError as exc:
        raise ConfigError(f"--demo is not available in this build ({exc})") from None

    try:
        # cache dir None: its default (LLAMASERVE_CACHE_DIR)
        demo = ensure_demo_checkpoint(config.demo_cache_dir, weights=config.demo_weights)
    except CheckpointError as exc:  # e.g. not cached and no network; the message says what to fetch
        raise ConfigError(f"--demo: {exc}") from None
    spec = ModelSpec(
        model_id=demo.model_id, checkpoint_dir=Path(demo.checkpoint_dir),
        llama_model=getattr(demo, "llama_model", None), metadata=dict(getattr(demo, "metadata", {}) or {}),
        trusted=True,
    )
    others = [m for m in config.models if m.model_id != spec.model_id]
    return dataclasses.replace(config, models=[*others, spec])


def with_batch_dir(config: ServerConfig) -> ServerConfig:
    """A served CLI keeps Batch API state across restarts: <cache dir>/batches unless configured."""
    if config.batch_dir is not None:
        return config
    from engine.loading.demo import default_cache_dir  # LLAMASERVE_CACHE_DIR or ~/.cache/llamaserve

    return dataclasses.replace(config, batch_dir=default_cache_dir() / "batches")


def serve(config: ServerConfig) -> None:
    """Run until SIGINT/SIGTERM, then drain (server/drain.py): new requests get 503 with Retry-After
    while in-flight ones get up to drain_timeout_s to finish (handler cancellation aborts the rest
    in the engine); then the cleanup context stops every engine and its model-parallel workers."""
    from engine.loader import LocalEngineFactory
    from server import drain
    from server.app import create_app
    from server.safety import exposure_warning
    import structlog

    warning = exposure_warning(config)
    if warning:
        structlog.get_logger("llamaserve.startup").warning(f"SECURITY WARNING: {warning}")
    factory = LocalEngineFactory(config.engine, chat_template_path=config.chat_template)
    app = create_app(config, factory)
    drain.run(app, host=config.host, port=config.port, drain_timeout_s=config.drain_timeout_s,
              loop_factory=new_event_loop)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


if __name__ == "__main__":
    sys.exit(main())
