"""Model-parallel processes: the process group, the step broadcast and the follower loop.

Rank 0 runs the server, scheduler and sampler. Each step it broadcasts a fixed int64 header
(op code + sizes) and then one flat int64 payload holding the StepInputs tensors; followers
(ranks 1..N-1) rebuild StepInputs from it, run the same forward and wait again. Nothing is
pickled and followers hold no scheduler state. gloo on CPU, nccl on CUDA, from the device.

Two ways to start:
- spawned (default): WorkerGroup with model_parallel_size N starts N-1 processes on this
  machine (`ParallelGroup.spawn`).
- torchrun (also multi-node): every rank runs the same command with the same config, e.g.
  `torchrun --nproc-per-node 2 -m server ...`; rank 0 builds the engine as usual (WorkerGroup
  sees WORLD_SIZE and joins the launched group instead of spawning) while ranks > 0 call
  `follow(spec, config, max_seq_len=...)` and return when rank 0 shuts down. WORLD_SIZE must
  equal model_parallel_size (no data parallelism).

Liveness: rank 0 checks its spawned processes before every step; a follower that dies mid-step
breaks the gloo/nccl connection, which raises on rank 0 instead of hanging. Either becomes
EngineDead. Once the group is loaded, rank 0 waits at most `config.mp_step_timeout_s` in any one
collective, so a hung (not dead) follower also ends in EngineDead, not a 30-minute stall.
fairscale's model-parallel group is process-global: one group per process at a time.

Exposure: spawned groups meet through a FileStore in a fresh 0700 temporary dir (its random name
is the token), so no rendezvous port is ever opened; their gloo/NCCL data sockets listen on the
loopback interface (`loopback_socket_env`), not on the address the hostname resolves to; spawned
followers poll their parent and exit when it is gone. Under torchrun the launcher's rendezvous
(--rdzv-endpoint) and socket settings are the operator's.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.executor.cross_attention import CrossAttentionUpdate
from engine.executor.step_inputs import StepInputs
from engine.types import EngineDead

log = logging.getLogger(__name__)

OP_STEP = 1
OP_STOP = 2
OP_LORA_LOAD = 3  # [op, lora id, path bytes, 0...], then the adapter folder's path as int64 bytes
OP_LORA_UNLOAD = 4  # [op, lora id, 0...]
OP_CROSS = 5  # Llama 3.2 Vision: a CrossAttentionUpdate, ahead of the step that reads it
OP_IMAGE = 6  # Llama 4: [op, chunks, channels, height, width, 0, 0, 0], then the pixels as float32: encode them
# OP_STEP: [op, num_tokens, num_seqs, max_blocks_per_seq, num_logits, num_image_rows, image_dim, has lora ids];
# with image rows, a third broadcast carries their embeddings as float64 (any model dtype round-trips exactly)
# OP_CROSS: [op, num_free, num_images, num_step_seqs, max_tiles, chunk_size, 0, 0]
HEADER_LEN = 8
# Rank 0 waits this long in one collective (covers followers loading their weights); a dead peer
# fails much sooner, as a broken connection.
COLLECTIVE_TIMEOUT_S = 1800.0
# Followers wait for the next step indefinitely while the server is idle.
FOLLOWER_TIMEOUT_S = 365 * 24 * 3600.0
STARTUP_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 10.0
PARENT_POLL_S = 0.5  # how often a spawned follower checks that the server process still exists


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if config.device == "cuda" else torch.device("cpu")


# --------------------------------------------------------------------------- a spawned group's sockets
def loopback_socket_env() -> dict[str, str]:
    """What binds a single-host group's data sockets to the loopback interface. Left alone, gloo
    listens on the address the hostname resolves to (often one other machines reach) and NCCL on
    its first non-loopback interface. gloo reads GLOO_SOCKET_IFNAME as each process group is
    created and NCCL reads NCCL_SOCKET_IFNAME when it first initializes, so both are set for the
    group's whole life, in rank 0 and (inherited) in the spawned followers."""
    name = _loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}  # "=": NCCL's exact name, not a prefix


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name.startswith("lo")), "lo")  # Linux: lo; macOS: lo0


def _override_env(values: dict[str, str]) -> dict[str, str | None]:
    """Set environment variables; what they were before, for `_restore_env`."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    return saved


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# --------------------------------------------------------------------------- the step protocol
def _pack(inputs: StepInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:5] = torch.tensor(
        [OP_STEP, inputs.num_tokens, inputs.num_seqs, inputs.block_tables.shape[1], inputs.logits_indices.shape[0]]
    )
    parts = [
        inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables.reshape(-1),
        inputs.query_start_loc, inputs.seq_lens, inputs.logits_indices,
    ]  # fmt: skip
    if inputs.image_rows is not None:
        header[5:7] = torch.tensor(list(inputs.image_embeds.shape))
        parts.append(inputs.image_rows)
    if inputs.lora_ids is not None:
        header[7] = 1
        parts.append(inputs.lora_ids)
    payload = torch.cat([p.to(torch.int64) for p in parts])
    return header.to(device), payload.to(device)


def image_embeds_payload(inputs: StepInputs, device: torch.device) -> torch.Tensor | None:
    """The step's image embeddings as followers receive them (after the header and payload)."""
    if inputs.image_embeds is None:
        return None
    return inputs.image_embeds.to(device=device, dtype=torch.float64)


def _unpack(header: list[int], payload: torch.Tensor) -> StepInputs:
    _, num_tokens, num_seqs, max_blocks, num_logits, num_image_rows, _, has_lora = header
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * max_blocks, num_seqs + 1, num_seqs, num_logits, num_image_rows]
    ids, pos, slots, tables, qsl, lens, logits, image_rows, *lora = torch.split(payload, sizes + [num_seqs] * has_lora)
    return StepInputs(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        logits_indices=logits,
        image_rows=image_rows if num_image_rows else None,
        lora_ids=lora[0] if lora else None,
    )


def payload_len(header: list[int]) -> int:
    _, num_tokens, num_seqs, max_blocks, num_logits, num_image_rows, _, has_lora = header
    return 3 * num_tokens + num_seqs * max_blocks + 2 * num_seqs + 1 + num_logits + num_image_rows + has_lora * num_seqs


def pack_lora_load(lora_id: int, path: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload telling followers to read an adapter folder themselves (they share
    rank 0's file system): a path, not the tensors, so nothing is pickled and each rank reads only
    what it cuts its shard from."""
    data = list(path.encode())
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:3] = torch.tensor([OP_LORA_LOAD, lora_id, len(data)])
    return header.to(device), torch.tensor(data, dtype=torch.int64).to(device)


def pack_lora_unload(lora_id: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:2] = torch.tensor([OP_LORA_UNLOAD, lora_id])
    return header.to(device)


def _pack_cross(update: CrossAttentionUpdate, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    _, max_tiles, _, chunk, _ = update.pixels.shape
    header[:6] = torch.tensor([OP_CROSS, update.free_seq_ids.numel(), update.num_images, update.step_seq_ids.numel(), max_tiles, chunk])
    ints = torch.cat([update.free_seq_ids, update.image_meta.reshape(-1), update.step_seq_ids])
    return header.to(device), ints.to(device), update.pixels.to(device=device, dtype=torch.float32)


def _recv_cross(header: list[int], device: torch.device) -> CrossAttentionUpdate:
    _, num_free, num_images, num_step, max_tiles, chunk = header[:6]
    ints = torch.empty(num_free + 5 * num_images + num_step, dtype=torch.int64, device=device)
    dist.broadcast(ints, src=0)
    pixels = torch.empty(num_images, max_tiles, 3, chunk, chunk, dtype=torch.float32, device=device)
    if num_images:
        dist.broadcast(pixels, src=0)
    free, meta, step = torch.split(ints.cpu(), [num_free, 5 * num_images, num_step])
    return CrossAttentionUpdate(free, meta.view(-1, 5), pixels, step)


@dataclass(frozen=True, slots=True)
class ImageToEncode:
    """OP_IMAGE: one image every rank encodes with its slice of the vision encoder, between steps.
    Followers drop their (identical) rows: the step that fuses them carries rank 0's, so followers
    keep no per-image state."""

    pixels: torch.Tensor  # [chunks, 3, tile, tile] float32


def _pack_image(pixels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:5] = torch.tensor([OP_IMAGE, *pixels.shape])
    return header.to(device), pixels.to(device=device, dtype=torch.float32)


def recv_step(device: torch.device, on_lora: Callable[[int, int, str | None], None] | None = None,
              ) -> StepInputs | CrossAttentionUpdate | ImageToEncode | None:
    """Followers: the next step's inputs (or a cross-attention update or an image to encode ahead of it), or None when
    rank 0 says stop. Adapter loads and unloads between steps go to on_lora(op, lora_id, path or
    None), in the order rank 0 sent them."""
    while True:
        header_t = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        dist.broadcast(header_t, src=0)
        header = header_t.tolist()
        if header[0] == OP_STOP:
            return None
        if header[0] == OP_LORA_LOAD:
            path_t = torch.empty(header[2], dtype=torch.int64, device=device)
            dist.broadcast(path_t, src=0)
            on_lora(OP_LORA_LOAD, header[1], bytes(path_t.tolist()).decode())  # type: ignore[misc]
            continue
        if header[0] == OP_LORA_UNLOAD:
            on_lora(OP_LORA_UNLOAD, header[1], None)  # type: ignore[misc]
            continue
        if header[0] == OP_CROSS:
            return _recv_cross(header, device)
        if header[0] == OP_IMAGE:
            pixels = torch.empty(header[1:5], dtype=torch.float32, device=device)
            dist.broadcast(pixels, src=0)
            return ImageToEncode(pixels)
        if header[0] != OP_STEP:
            raise RuntimeError(f"model-parallel protocol error: op code {header[0]}")
        payload = torch.empty(payload_len(header), dtype=torch.int64, device=device)
        dist.broadcast(payload, src=0)
        inputs = _unpack(header, payload)
        if header[5]:
            embeds = torch.empty(header[5], header[6], dtype=torch.float64, device=device)
            dist.broadcast(embeds, src=0)
            inputs.image_embeds = embeds
        return inputs


# --------------------------------------------------------------------------- rank 0's view of the group
@dataclass
class ParallelGroup:
    """Rank 0's handle on the model-parallel group: broadcast, liveness, shutdown."""

    world_size: int
    device: torch.device
    processes: list[Any]  # spawned followers (empty under torchrun)
    dead_reason: str | None = None
    step_timeout_s: float | None = None  # set once loaded: the bound on each later collective
    store_dir: str | None = None  # the spawned group's private rendezvous dir, removed at shutdown
    saved_env: dict[str, str | None] | None = None  # what loopback_socket_env replaced, restored at shutdown

    @classmethod
    def spawn(cls, config: EngineConfig, spec: Any, *, max_seq_len: int) -> "ParallelGroup":
        """Start ranks 1..N-1 as spawned processes and join them as rank 0."""
        import torch.multiprocessing as mp

        world_size = config.model_parallel_size
        device = rank_device(config, 0)
        store_dir = tempfile.mkdtemp(prefix="llamaserve-mp-")  # 0700, random name: only we can meet there
        init_method = f"file://{os.path.join(store_dir, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        saved_env = _override_env(loopback_socket_env())  # before the followers start: they inherit it
        group = cls(world_size, device, [], step_timeout_s=config.mp_step_timeout_s, store_dir=store_dir,
                    saved_env=saved_env)
        try:
            for rank in range(1, world_size):
                proc = ctx.Process(
                    target=_spawned_main,
                    args=(rank, world_size, init_method, spec, config, max_seq_len, logging.getLogger().level,
                          os.getpid()),
                    name=f"llamaserve-mp{rank}",
                    daemon=True,
                )
                proc.start()
                group.processes.append(proc)
            group._init_rank0(init_method)
        except BaseException:
            group.shutdown()
            raise
        return group

    @classmethod
    def join_launched(cls, config: EngineConfig) -> "ParallelGroup":
        """Rank 0 under torchrun: the launcher started the other ranks."""
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != config.model_parallel_size:
            raise ValueError(f"torchrun WORLD_SIZE {world_size} != model_parallel_size {config.model_parallel_size}")
        watch_parent(os.getppid(), "torchrun launcher")
        device = rank_device(config, int(os.environ.get("LOCAL_RANK", "0")))
        init_group(device, rank=0, world_size=world_size, init_method="env://", timeout_s=COLLECTIVE_TIMEOUT_S)
        return cls(world_size, device, [], step_timeout_s=config.mp_step_timeout_s)

    def _init_rank0(self, init_method: str) -> None:
        # init_process_group blocks until every rank connects; run it aside so a follower that
        # dies while starting is reported instead of waited on.
        errors: list[BaseException] = []

        def target() -> None:
            try:
                init_group(self.device, rank=0, world_size=self.world_size, init_method=init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        thread = threading.Thread(target=target, name="llamaserve-mp-init", daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.05)
            self.check_alive()
            if time.monotonic() > deadline:
                raise EngineDead(f"model-parallel workers did not connect within {STARTUP_TIMEOUT_S:.0f} s")
        if errors:
            raise EngineDead(f"model-parallel group failed to start: {errors[0]}") from errors[0]

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                self.dead_reason = f"model-parallel worker rank {rank} exited (exit code {proc.exitcode})"
                raise EngineDead(self.dead_reason)

    def broadcast_step(self, inputs: StepInputs) -> None:
        self.check_alive()
        header, payload = _pack(inputs, self.device)
        embeds = image_embeds_payload(inputs, self.device)
        self.collective(lambda: (dist.broadcast(header, src=0), dist.broadcast(payload, src=0),
                                 embeds is not None and dist.broadcast(embeds, src=0)))

    def broadcast_cross(self, update: CrossAttentionUpdate) -> None:
        self.check_alive()
        header, ints, pixels = _pack_cross(update, self.device)

        def send() -> None:
            dist.broadcast(header, src=0)
            dist.broadcast(ints, src=0)
            if update.num_images:
                dist.broadcast(pixels, src=0)

        self.collective(send)

    def broadcast_image(self, pixels: torch.Tensor) -> None:
        self.check_alive()
        header, data = _pack_image(pixels, self.device)
        self.collective(lambda: (dist.broadcast(header, src=0), dist.broadcast(data, src=0)))

    def collective(self, fn):
        """Run rank 0's part of a collective; a broken group becomes EngineDead."""
        self.check_alive()
        try:
            return fn()
        except (RuntimeError, dist.DistError) as exc:
            self.dead_reason = f"model-parallel group failed: {exc}".splitlines()[0]
            try:
                self.check_alive()  # prefer the precise reason when a process is gone
            except EngineDead:
                pass
            raise EngineDead(self.dead_reason) from exc

    def broadcast_lora_load(self, lora_id: int, path: str) -> None:
        self.check_alive()
        header, payload = pack_lora_load(lora_id, path, self.device)
        self.collective(lambda: (dist.broadcast(header, src=0), dist.broadcast(payload, src=0)))

    def broadcast_lora_unload(self, lora_id: int) -> None:
        self.check_alive()
        header = pack_lora_unload(lora_id, self.device)
        self.collective(lambda: dist.broadcast(header, src=0))

    def agree_min(self, value: int) -> int:
        """The smallest value over all ranks (KV blocks: every rank must hold the same count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN))
        self._bound_step_waits()  # every rank has loaded its weights: no wait need be long from here on
        return int(t.item())

    def _bound_step_waits(self) -> None:
        """Lower this rank's collective timeout from the load-time bound to the per-step one."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        if self.step_timeout_s is not None:
            _set_pg_timeout(datetime.timedelta(seconds=self.step_timeout_s))

    def shutdown(self) -> None:
        """Tell followers to stop, wait for them, and free the process-global group."""
        if self.dead_reason is None and dist.is_initialized():
            try:
                self.check_alive()
                stop = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
                stop[0] = OP_STOP
                work = dist.broadcast(stop, src=0, async_op=True)
                work.wait(datetime.timedelta(seconds=JOIN_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - best effort: followers are killed below
                log.warning("could not send STOP to model-parallel workers: %s", exc)
        for proc in self.processes:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                log.warning("killing model-parallel worker %s", proc.name)
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        destroy_group()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.saved_env is not None:
            _restore_env(self.saved_env)
            self.saved_env = None


def group_in_use() -> bool:
    """Whether this process already holds a torch.distributed / fairscale model-parallel group."""
    import fairscale.nn.model_parallel.initialize as fs_init

    return dist.is_initialized() or fs_init.model_parallel_is_initialized()


def init_group(device: torch.device, *, rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    """torch.distributed + fairscale's model-parallel group (the whole world is one MP group)."""
    import fairscale.nn.model_parallel.initialize as fs_init

    if fs_init.model_parallel_is_initialized():
        raise RuntimeError(
            "this process already holds a model-parallel group: one model with model_parallel_size > 1 per process"
        )
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    fs_init.initialize_model_parallel(world_size)


def destroy_group() -> None:
    import fairscale.nn.model_parallel.initialize as fs_init

    fs_init.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- followers
def follow(spec: Any, config: EngineConfig, *, max_seq_len: int) -> None:
    """Entry for ranks > 0 under torchrun: load this rank's weights, serve steps until STOP.
    spec is an engine.loading.checkpoint.CheckpointSpec resolved from the same config as rank 0's."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun passes its SIGTERM (and a terminal's SIGINT reaches the whole group) to every rank at
    # once: a follower that died then would cut the requests rank 0 is draining. Followers stop on
    # rank 0's STOP, or when the group breaks because rank 0 is gone; the launcher still SIGKILLs a
    # rank that outlives its grace period.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    watch_parent(os.getppid(), "torchrun launcher")
    device = rank_device(config, int(os.environ.get("LOCAL_RANK", str(rank))))
    init_group(device, rank=rank, world_size=world_size, init_method="env://", timeout_s=FOLLOWER_TIMEOUT_S)
    try:
        _serve(spec, config, rank=rank, device=device, max_seq_len=max_seq_len)
    finally:
        destroy_group()


def _spawned_main(
    rank: int, world_size: int, init_method: str, spec: Any, config: EngineConfig, max_seq_len: int, log_level: int,
    parent_pid: int,
) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s mp{rank} %(levelname)s %(name)s: %(message)s")
    watch_parent(parent_pid, "server process")
    device = rank_device(config, rank)
    init_group(device, rank=rank, world_size=world_size, init_method=init_method, timeout_s=FOLLOWER_TIMEOUT_S)
    try:
        _serve(spec, config, rank=rank, device=device, max_seq_len=max_seq_len)
    finally:
        destroy_group()


def watch_parent(parent_pid: int, what: str) -> None:
    """Exit at once when the parent is gone (this process re-parented). A follower whose server died
    (SIGKILL, OOM) would otherwise wait in a collective forever; under torchrun, every rank of a
    launcher that was SIGKILLed would keep running (rank 0 serving, holding its port) with nothing
    left to stop it. A thread polling getppid, not PR_SET_PDEATHSIG: that fires when the forking
    *thread* exits, which for a launcher is not the launcher's death."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.error("the %s (pid %d) is gone: exiting", what, parent_pid)
        os._exit(3)

    threading.Thread(target=watch, name="llamaserve-parent-watch", daemon=True).start()


def _serve(spec: Any, config: EngineConfig, *, rank: int, device: torch.device, max_seq_len: int) -> None:
    from engine.executor.worker import Worker

    shard = Worker.load(spec, config, rank=rank, device=device, max_seq_len=max_seq_len)
    num_blocks = torch.tensor([shard.plan_num_blocks(config)], dtype=torch.int64, device=device)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
    shard.allocate_kv_cache(int(num_blocks.item()))
    log.info("model-parallel rank %d ready", rank)

    def on_lora(op: int, lora_id: int, path: str | None) -> None:
        if op == OP_LORA_LOAD:
            shard.load_adapter_from(lora_id, path, config)  # type: ignore[arg-type]
        else:
            shard.unload_adapter(lora_id)

    while (message := recv_step(device, on_lora)) is not None:
        if isinstance(message, CrossAttentionUpdate):
            shard.update_cross_attention(message)  # collectives inside (the image encoder): in step with rank 0
        elif isinstance(message, ImageToEncode):
            shard.encode_image(message.pixels)  # collectives inside; the rows are rank 0's to send
        else:
            shard.forward(message)
    log.info("model-parallel rank %d stopping", rank)
