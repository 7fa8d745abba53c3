"""MODEL_PARALLEL_SIZE=2 on CPU (gloo, one spawned follower) against size 1 on the same weights.

Each case spawns one process; sizes are tiny and each executor runs one short schedule.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket

import pytest
import torch

from engine.types import EngineDead, InvalidRequest
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

pytestmark = pytest.mark.timeout(240)

PROMPT_LENGTHS = [3, 9, 14]


def _run(checkpoint, mp_size: int, dtype: str):
    executor = make_executor(checkpoint, mp_size=mp_size, dtype=dtype)
    followers = list(executor._group.processes) if mp_size > 1 else []
    try:
        return run_random_schedule(executor, random_prompts(256, PROMPT_LENGTHS, seed=21), seed=21, max_new=4)
    finally:
        executor.shutdown()
        assert [p.exitcode for p in followers] == [0] * len(followers)  # STOP ends them cleanly


@pytest.fixture(scope="module")
def mp1_results(tiny_checkpoint):
    return {dtype: _run(tiny_checkpoint, 1, dtype) for dtype in ("float64", "float32")}


@pytest.mark.parametrize(
    "shards, dtype, tolerance",
    [
        ("1->2", "float64", 1e-9),
        ("2->2", "float64", 1e-9),
        ("2->1", "float64", 1e-9),
        ("1->2", "float32", 1e-4),  # the production path: oneDNN-packed linears plus collectives
    ],
)
def test_mp_matches_single_process(request, mp1_results, shards, dtype, tolerance):
    """Same greedy tokens and near-identical logits, whatever the saved and the run sizes."""
    saved, run = (int(x) for x in shards.split("->"))
    checkpoint = request.getfixturevalue("tiny_checkpoint" if saved == 1 else "tiny_checkpoint_2shards")
    results = _run(checkpoint, run, dtype)
    for seq_id, (logits, tokens) in mp1_results[dtype].items():
        other_logits, other_tokens = results[seq_id]
        assert other_tokens == tokens
        torch.testing.assert_close(other_logits, logits, atol=tolerance, rtol=tolerance)


def test_dead_worker_is_reported(tiny_checkpoint):
    executor = make_executor(tiny_checkpoint, mp_size=2)
    try:
        with pytest.raises(InvalidRequest, match="another model with model_parallel_size > 1 is loaded"):
            make_executor(tiny_checkpoint, mp_size=2)  # one model-parallel group per process
        follower = executor._group.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(30)
        with pytest.raises(EngineDead, match="rank 1"):
            run_random_schedule(executor, random_prompts(256, [5], seed=1), seed=1, max_new=1)
        with pytest.raises(EngineDead):  # stays dead
            run_random_schedule(executor, random_prompts(256, [5], seed=1), seed=1, max_new=1)
    finally:
        executor.shutdown()  # must not hang on the dead follower
    assert not follower.is_alive()


# --------------------------------------------------------------------------- hardening (issue 16)
def test_spawned_group_meets_in_a_private_dir_and_removes_it(tiny_checkpoint):
    import stat

    executor = make_executor(tiny_checkpoint, mp_size=2)
    store_dir = executor._group.store_dir
    try:
        assert store_dir is not None and stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700  # no rendezvous port
    finally:
        executor.shutdown()
    assert not os.path.exists(store_dir)


def test_spawned_group_sockets_listen_on_loopback_only(tiny_checkpoint):
    """Issue 29 (11): gloo's data sockets listened on the address the hostname resolves to."""
    names = {name for _, name in socket.if_nameindex()}
    before = os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")
    executor = make_executor(tiny_checkpoint, mp_size=2)
    follower = executor._group.processes[0]
    try:
        for env in (_environ_of(follower.pid), os.environ):  # the follower inherits rank 0's, set for the group's life
            assert env["GLOO_SOCKET_IFNAME"] in names and env["GLOO_SOCKET_IFNAME"].startswith("lo")
            assert env["NCCL_SOCKET_IFNAME"] == "=" + env["GLOO_SOCKET_IFNAME"]
        addresses = _tcp_addresses(follower.pid)
        assert addresses, "the follower holds no TCP socket: gloo connects its ranks over TCP"
        assert all(address.is_loopback for address in addresses), addresses
    finally:
        executor.shutdown()
    assert (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")) == before


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _tcp_addresses(pid: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of a process's TCP sockets (listening and connected), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    addresses = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    addresses.append(_proc_address(fields[1].split(":")[0]))
    return addresses


def _proc_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp* writes an address as 32-bit words in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    return address.ipv4_mapped or address if isinstance(address, ipaddress.IPv6Address) else address


def test_a_hung_worker_ends_in_an_error_not_a_hang(tiny_checkpoint):
    """SIGSTOP leaves the follower alive but silent: rank 0's next collective times out after
    mp_step_timeout_s instead of the 30-minute load-time bound."""
    executor = make_executor(tiny_checkpoint, mp_size=2, mp_step_timeout_s=3.0)
    follower = executor._group.processes[0]
    try:
        run_random_schedule(executor, random_prompts(256, [5], seed=1), seed=1, max_new=1)  # healthy first
        os.kill(follower.pid, signal.SIGSTOP)
        with pytest.raises((EngineDead, RuntimeError)):
            run_random_schedule(executor, random_prompts(256, [5], seed=2), seed=2, max_new=2)
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(30)
        executor.shutdown()


def test_spawned_workers_exit_when_the_server_process_dies(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    from tests.e2e.conftest import wait_until

    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from tests.engine.test_model import make_executor\n"
        "if __name__ == '__main__':  # spawned followers re-import this file\n"
        f"    executor = make_executor({str(tiny_checkpoint)!r}, mp_size=2)\n"
        "    print('follower', executor._group.processes[0].pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=repo, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": repo})
    try:
        follower_pid = int(next(line for line in parent.stdout if line.startswith("follower ")).split()[1])
        assert _running(follower_pid)
        parent.kill()  # SIGKILL: no shutdown, no STOP broadcast
        parent.wait(30)
        wait_until(lambda: not _running(follower_pid), timeout_s=30, what="the orphaned follower to exit")
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger where PID 1 does not reap)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


def test_the_parent_watch_exits_an_orphan_that_is_not_in_a_collective(tmp_path):
    """gloo also breaks a follower waiting in a broadcast when its peer dies; the parent watch covers
    the rest (a follower still loading weights, NCCL): here a process that only runs the watch."""
    import subprocess
    import sys

    from tests.e2e.conftest import wait_until

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The parent's pid is read before the pid is printed: the test kills the parent as soon as it reads it.
    child = ("import os, time; from engine.executor.parallel import watch_parent; parent = os.getppid(); "
             "watch_parent(parent, 'test parent'); print(os.getpid(), flush=True); time.sleep(600)")
    middle = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)"],
        cwd=repo, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": repo},
    )
    try:
        orphan_pid = int(middle.stdout.readline())
        assert _running(orphan_pid)
        middle.kill()
        middle.wait(30)
        wait_until(lambda: not _running(orphan_pid), timeout_s=30, what="the orphan to notice its parent is gone")
    finally:
        middle.kill()
