"""The ranks' start-up cannot lose its port, and a restart never reads an earlier attempt's keys
(megatron_lite/rendezvous.py: group_store).

The theft is forced, not hoped for: THIEF is a sitecustomize.py that the tests put on
PYTHONPATH (test harness, nothing in the product). In every Python process of a launch (the
launcher, torchrun's agent, the ranks) it takes any TCP port the process binds and then
releases, at the moment it is released, and holds it: the worst case of the race in which
torchrun chose a port by binding port 0 and closing it, and another process took it before
rank 0 bound it. It also holds rank 0 back at the restart, so the other ranks reach the store
first (where an earlier attempt's keys are still waiting). The end-to-end run is
tests/launch/test_fault_tolerance.py::test_killed_rank_restarts_group_and_resumes_with_same_losses,
which runs under it; the handshake's own rules are checked here on a store of our own.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_lite.rendezvous import StartupError, group_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

THIEF = """\
import os
import socket
import time

_held = []  # the stolen ports, held until the process exits
if os.environ.get("MEGATRON_TEST_STEAL_PORTS") == "1":
    _close = socket.socket.close

    def _stealing_close(self):
        port = None
        if self.family in (socket.AF_INET, socket.AF_INET6) and self.type == socket.SOCK_STREAM:
            try:
                port = self.getsockname()[1]
                self.getpeername()  # connected: its port is a client's, nobody hands it out
                port = None
            except OSError:
                pass
        _close(self)
        if port:
            try:
                thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                thief.bind(("", port))
                thief.listen()
                _held.append(thief)
            except OSError:
                pass

    socket.socket.close = _stealing_close
if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    time.sleep(float(os.environ.get("MEGATRON_TEST_LATE_RANK0_S", "0")))
"""


def thief_env(tmp_path) -> dict[str, str]:
    """Environment for a launch under THIEF: ports stolen, rank 0 late by 3 s at a restart."""
    site = tmp_path / "thief"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(THIEF)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return dict(
        os.environ,
        PYTHONPATH=path,
        MEGATRON_TEST_STEAL_PORTS="1",
        MEGATRON_TEST_LATE_RANK0_S="3",
    )


def test_the_thief_takes_a_port_chosen_by_bind_and_close(tmp_path):
    """The harness can make the end-to-end test fail: torch's own port choice for a rank-hosted
    store (get_free_port, used under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is stolen."""
    code = (
        "import socket\n"
        "from torch.distributed.elastic.utils.distributed import get_free_port\n"
        "port = get_free_port()\n"
        "s = socket.socket()\n"
        "try:\n"
        "    s.bind(('', port))\n"
        "    print('free', port)\n"
        "except OSError as e:\n"
        "    print('taken', port, e.errno)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=thief_env(tmp_path), capture_output=True, text=True
    )
    assert r.stdout.startswith("taken"), r.stdout + r.stderr


# ---------------------------------------------------------------- the handshake, on our own store
def _attempt_rank(rank, world, port, restart_count, late_s, queue):
    """One rank of an attempt, with torchrun's environment: the store, then a gloo group."""
    import time

    import torch

    os.environ.update(
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
    )
    try:
        time.sleep(late_s)
        timeout = datetime.timedelta(seconds=20)
        store = group_store(rank, world, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        queue.put((rank, t.item()))
    except Exception as e:  # reported to the test, which names it
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _run_attempt(world, port, counts, late) -> dict[int, object]:
    ctx = mp.get_context("forkserver")  # children fork from a process that imported torch
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_lite.rendezvous"])
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_attempt_rank, args=(r, world, port, counts[r], late[r], queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.timeout(300)
def test_restart_reads_no_key_of_an_earlier_attempt():
    """Attempt 0 leaves its gloo addresses (and a nonce whose rank died unanswered) in the
    store; in attempt 1 rank 0 starts 3 s late and the ranks disagree on
    TORCHELASTIC_RESTART_COUNT (an agent of another node whose ranks were healthy restarts
    them without counting): every rank still joins this attempt's group."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world, want = 3, 6.0  # all-reduce of rank + 1
    first = _run_attempt(world, agent.port, counts=[0, 0, 0], late=[0, 0, 0])
    assert first == {r: want for r in range(world)}, first
    agent.append("megatron_lite/rdzv/hellos", "0123456789abcdef;")  # a rank killed waiting
    second = _run_attempt(world, agent.port, counts=[1, 1, 0], late=[3, 0, 0])
    assert second == {r: want for r in range(world)}, second
    assert not agent.check(["megatron_lite/rdzv/hellos"]), "the nonce list was not cleared"


def _agent_env(monkeypatch, port: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


def test_rank0_alone_times_out_naming_the_ranks_that_never_joined(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _agent_env(monkeypatch, agent.port)
    with pytest.raises(StartupError) as e:
        group_store(0, 4, datetime.timedelta(seconds=1))
    message = str(e.value)
    assert message.startswith("rank 0: waited 1 s"), message
    assert "rank(s) 1-3 of 4 never did" in message and "parallel.timeout_s" in message, message


def test_rank_without_rank0_times_out_naming_rank0_and_the_store(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _agent_env(monkeypatch, agent.port)
    with pytest.raises(StartupError) as e:
        group_store(2, 4, datetime.timedelta(seconds=1))
    message = str(e.value)
    assert message.startswith("rank 2: waited 1 s (parallel.timeout_s) for rank 0"), message
    assert f"127.0.0.1:{agent.port} (MASTER_ADDR:MASTER_PORT)" in message, message


@pytest.mark.slow
def test_unreachable_agent_store_is_one_message(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _agent_env(monkeypatch, port)
    with pytest.raises(StartupError) as e:
        group_store(1, 2, datetime.timedelta(seconds=1))
    message = str(e.value)
    assert message.startswith(f"rank 1: could not reach torchrun's store at 127.0.0.1:{port}")
    assert "Fix: start the ranks with torchrun" in message, message


def test_without_the_agent_store_env_rendezvous_is_torchs(monkeypatch):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the agent says False) or no torchrun: env://."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert group_store(0, 2, datetime.timedelta(seconds=1)) is None
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert group_store(0, 2, datetime.timedelta(seconds=1)) is None


def test_rank0_that_cannot_bind_its_port_says_so(monkeypatch):
    """Where torchrun lets rank 0 host the store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and the
    port is taken: one line naming the rank, MASTER_ADDR:MASTER_PORT and the fix."""
    from megatron_lite.config import Config
    from megatron_lite.train import init_distributed

    cfg = Config()
    cfg.parallel.timeout_s = 5
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        port = thief.getsockname()[1]
        for key, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1").items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
        try:
            with pytest.raises(StartupError) as e:
                init_distributed(cfg)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    message = str(e.value)
    want = f"rank 0: could not host the process group's store at 127.0.0.1:{port}"
    assert message.startswith(want), message
    assert "Fix: unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in message, message


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_nodes_that_never_join_end_in_one_line_naming_the_rendezvous():
    """torchrun's agent waiting for the other nodes (a node that never started): one line
    saying what it waited for, where and how long, exit 1; no traceback."""
    cmd = [sys.executable, "-m", "megatron_lite.torchrun", "--nnodes=2", "--nproc-per-node=1"]
    cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=lonely"]
    cmd += ["--rdzv-conf", "join_timeout=2", "-m", "megatron_lite.train"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "[launch] this node waited 2 s (--rdzv-conf join_timeout)" in out, out[-3000:]
    assert "for --nnodes=2" in out and "Traceback" not in out, out[-3000:]
