"""A real Slurm cluster of two nodes on this one machine, for the launch tests.

    with SlurmCluster(tmp_dir) as cluster:          # ~5 s bring-up
        job = cluster.sbatch(["launch/slurm/train.sbatch", ...], env)
        info = cluster.wait(job, "COMPLETED")

Debian's Slurm (22.05, built with multiple-slurmd support) runs one slurmctld and one slurmd
per node (`slurmd -N n1`, `-N n2`), all on 127.0.0.1 with distinct ports, plus a private munged;
every daemon's config, state, logs, pid file and socket live under the given directory, so
nothing touches /etc/slurm or the system munge. Nodes declare `CPUS` CPUs each whatever the
machine has (`SlurmdParameters=config_overrides`). Processes are tracked by pid (no cgroups,
no systemd), there is no accounting, and `batch_sched_delay=0` starts batch jobs at once.

torchrun's c10d rendezvous connects to the first node by name, so `n1` and `n2` must resolve:
`start()` adds a marked `127.0.0.1 n1 n2` line to /etc/hosts when they don't, and `stop()`
removes it. `stop()` ends every daemon by its pid file (also after a failed start).

Needs root (the daemons run as root, which Slurm allows with SlurmUser=root). `ensure_installed()`
installs the Debian packages with apt-get when the binaries are missing (CI starts from a fresh
machine); it takes ~10-30 s once.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
HOSTS_FILE = "/etc/hosts"
HOSTS_MARK = "# megatron_lite test slurm cluster"
CRED_EXPIRE_S = 5  # also how long a requeued job waits before it may start again


def ensure_installed() -> float:
    """Install Slurm and munge from Debian if a binary is missing; returns seconds spent."""
    if all(shutil.which(b) for b in BINARIES):
        return 0.0
    t0 = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        for attempt in range(3):  # a mirror's transient failure is retried
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if r.returncode == 0:
                break
            time.sleep(5 * (attempt + 1))
        else:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        raise RuntimeError(f"installed {PACKAGES} but {missing} are still not on PATH")
    return time.monotonic() - t0


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (and above the sbatch script's default
    rendezvous ports, 20000 + job id mod 10000), never the same twice in this process: a port
    the kernel hands out for `bind(0)` could be taken by another process's listener (gloo ranks
    of tests running beside these) between this check and the daemon's own bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    candidates = [p for p in range(30000, max(ephemeral_low, 30001)) if p not in _HANDED_OUT]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)  # not bound yet: never hand it out twice
            return port
    raise RuntimeError(f"no free port in 30000..{ephemeral_low - 1}")


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class SlurmCluster:
    """One controller and `len(nodes)` slurmd daemons on 127.0.0.1, state under `root`."""

    def __init__(self, root: str | os.PathLike, nodes=("n1", "n2"), cpus: int = 4):
        self.root = Path(root)
        self.nodes, self.cpus = tuple(nodes), cpus
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._added_hosts = False
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_config()
        self._add_hosts()
        self._daemon(["slurmctld", "-f", str(self.conf)], self.root / "slurmctld.pid")
        for n in self.nodes:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", n], self.root / f"slurmd-{n}.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {timeout:.0f}s: {r.stdout}{r.stderr}\n"
                           f"{self.logs()}")  # fmt: skip

    def stop(self) -> None:
        """End every daemon by its pid file (the slurmds, then the controller and munged),
        then undo the /etc/hosts entry."""
        self._kill([self.root / f"slurmd-{n}.pid" for n in self.nodes])
        self._kill([self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"])
        self._remove_hosts()

    # ------------------------------------------------------------------ jobs
    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        kw.setdefault("env", self.env)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr}")
        return r

    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> int:
        """Submit with `sbatch --parsable ARGS`; returns the job id."""
        r = self.run(["sbatch", "--parsable", *args], env=dict(self.env, **(env or {})), cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def wait(self, job_id: int, states, timeout: float, poll: float = 0.2) -> dict[str, str]:
        """Wait until the job's state is one of `states` (a str or a tuple); returns its info."""
        states = (states,) if isinstance(states, str) else tuple(states)
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while info["JobState"] not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} is {info['JobState']} after {timeout:.0f}s, waiting for "
                    f"{states}: {info}\n{self.logs()}"
                )
            time.sleep(poll)
            info = self.job(job_id)
        return info

    def logs(self, tail: int = 2000) -> str:
        """The daemons' log tails, for failure messages."""
        out = []
        for log in sorted(self.root.glob("*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    # ------------------------------------------------------------------ internals
    def _start_munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o700, exist_ok=True)
        key = d / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        self._daemon(
            [
                "munged",
                "--force",  # running as root
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
            d / "munged.pid",
        )

    def _write_config(self) -> None:
        r = self.root
        ctld_host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.cpus} State=UNKNOWN"
            for n in self.nodes
        )
        self.conf.write_text(
            f"""ClusterName=mltest
SlurmctldHost={ctld_host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=10
MinJobAge=600
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, cmd: list[str], pidfile: Path, timeout: float = 10.0) -> None:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr}\n"
                               f"{self.logs()}")  # fmt: skip
        deadline = time.monotonic() + timeout
        while not pidfile.exists():  # the daemons write it after forking
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} wrote no pid file {pidfile}\n{self.logs()}")
            time.sleep(0.05)

    @staticmethod
    def _kill(pidfiles: list[Path], timeout: float = 10.0) -> None:
        """SIGTERM the daemons of `pidfiles` together, wait, SIGKILL whatever is left."""
        pids = []
        for pidfile in pidfiles:
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError, IndexError):  # no file, or the daemon is gone
                continue
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _running(p)]
            time.sleep(0.05)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _add_hosts(self) -> None:
        if all(_resolves(n) for n in self.nodes):
            return
        with open(HOSTS_FILE, "a") as f:
            f.write(f"127.0.0.1 {' '.join(self.nodes)} {HOSTS_MARK}\n")
        self._added_hosts = True

    def _remove_hosts(self) -> None:
        if not self._added_hosts:
            return
        with open(HOSTS_FILE) as f:
            lines = f.readlines()
        with open(HOSTS_FILE, "w") as f:  # in place: /etc/hosts may be a bind mount
            f.writelines(line for line in lines if HOSTS_MARK not in line)
        self._added_hosts = False
