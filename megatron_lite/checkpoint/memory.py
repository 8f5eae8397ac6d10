"""In-memory checkpoints (train.memory_checkpoint_interval): every K steps each rank writes its
state to host memory that outlives the process (/dev/shm) and a replica of it to a peer rank,
so that a group torchrun restarts after a rank's death resumes from there instead of disk.

    memory = MemoryCheckpoints(cfg, rank, world, ranks, group)   # collective: run id, peers
    memory.check_space(nbytes)                                   # collective, at the start
    plan = memory.plan()          # collective: the newest step complete for every rank
    header = memory.load(plan, targets)                           # collective
    memory.save(step, consumed_samples, tensors)                  # collective, every K steps
    memory.remove()                                               # at a clean end

What a rank saves is what a disk checkpoint restores on it in the same layout (the
Checkpointer builds it from holdings.load_targets: its weights, optimizer states and step
counts, and its RNG states), as the raw bytes of each tensor (memory_files.py), so a resume
continues bitwise. The file is written to a temporary name and renamed: complete or absent.

Peers: ranks are grouped by host; with several hosts, rank r's replica goes to
(r + ranks_per_node) % world (the same local rank on the next node), which receives it over the
checkpoint control group (gloo, in chunks); on one host to (r + 1) % world, which links the
file under its own name (a hard link: the same host's memory holds it once, and a restart of
the process does not lose it). The newest two steps are kept, so a rank that dies while a step
is written leaves the one before complete.

The run id names the directory (/dev/shm/megatron_lite-<id>) and is in every file's header. It
is a random id that rank 0 keeps in <out_dir>/memory_checkpoints.id: a fresh launch
(TORCHELASTIC_RESTART_COUNT unset or 0) draws a new one and removes the copies of the id it
replaces; a group torchrun restarts (count > 0) reads it. So a copy is only ever loaded by a
restart of the launch that wrote it, and a file whose header names another run, step, rank,
world size or settings (model, layout, optimizer: `fingerprint`) is ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import uuid

import torch
import torch.distributed as dist

from megatron_lite.atomic import write_atomic
from megatron_lite.checkpoint import memory_files as mf
from megatron_lite.checkpoint.errors import CheckpointWriteError
from megatron_lite.parallel.mappings import guarded

SHM_ROOT = "/dev/shm"
ID_FILE = "memory_checkpoints.id"
KEY = "train.memory_checkpoint_interval"
CHUNK = 64 << 20  # bytes per p2p message: gloo sends one buffer at a time
STEPS_KEPT = 2
_ID = re.compile(r"^[0-9a-f]{16}$")


class MemoryCheckpointError(CheckpointWriteError):
    """An in-memory checkpoint could not be written; the disk checkpoints are untouched."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The step every rank's copy is complete for; `sources[r]` = (rank that holds the file r
    loads (r itself: read on its own host), the file's name, its bytes)."""

    step: int
    sources: dict[int, tuple[int, str, int]]


def fingerprint(cfg) -> str:
    """What a copy's tensors depend on (model, layout, optimizer and its dtypes): a copy is
    loaded only by a run whose settings give the same value."""
    t = cfg.train
    keys = {"model": cfg.model, "parallel": cfg.parallel}
    keys["train"] = (t.optimizer, t.precision, t.optimizer_offload)
    text = json.dumps({k: str(v) for k, v in keys.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _restart_count() -> int:
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def _choose_run_id(out_dir: str) -> tuple[str, str | None]:
    """Rank 0: (this run's id, a replaced id whose copies are stale)."""
    path = os.path.join(out_dir, ID_FILE)
    old = None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(path) as f:
            text = f.read(64).strip()
        old = text if _ID.match(text) else None
    if old is not None and _restart_count() > 0:
        return old, None
    new = uuid.uuid4().hex[:16]
    write_atomic(path, new + "\n")
    return new, old


class MemoryCheckpoints:
    """One run's in-memory copies on this rank; every method is collective over `ranks`
    (a RankAgreement of all `world` ranks) and its gloo `group`."""

    def __init__(self, cfg, rank: int, world: int, ranks, group, root: str = SHM_ROOT):
        self.interval, self.rank, self.world = cfg.train.memory_checkpoint_interval, rank, world
        self.ranks, self.group, self.root, self.settings = ranks, group, root, fingerprint(cfg)
        out_dir = cfg.train.out_dir
        self.run_id, stale = ranks.from_rank0(lambda: _choose_run_id(out_dir), io="write")
        self.dir = mf.run_root(root, self.run_id)
        self.hosts: list[str] = ranks.on_every_rank(self._open, "memory checkpoint dir", True)
        if stale is not None:  # an earlier launch's copies: never loaded, so freed now
            shutil.rmtree(mf.run_root(root, stale), ignore_errors=True)
        nodes = len(set(self.hosts))
        shift = self.hosts.count(self.hosts[0]) if nodes > 1 else 1
        self.peer, self.source = (rank + shift) % world, (rank - shift) % world

    def _open(self) -> str:
        if not os.path.isdir(self.root):
            raise self._error(self.root, f"{self.root} does not exist on this host")
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise self._error(self.dir, f"{type(e).__name__}: {e}") from None
        return socket.gethostname()

    def _error(self, path: str, why: str) -> MemoryCheckpointError:
        return MemoryCheckpointError(
            f"{KEY}={self.interval}: rank {self.rank} cannot write in-memory checkpoints to "
            f"{path}: {why}. The disk checkpoints are untouched. Fix: free space in "
            f"{self.root} (or enlarge it: mount -o remount,size=... {self.root}), raise "
            f"{KEY}, or set {KEY}=0 and rely on train.save_interval"
        )

    # ------------------------------------------------------------------ start
    def check_space(self, nbytes: int) -> None:
        """Refuse to start (on every rank) when a host's free memory in the root cannot hold
        STEPS_KEPT steps of its ranks' copies (`nbytes` each) and the replicas sent there."""
        table = self.ranks.all_gather((nbytes, self.hosts[self.rank]), "memory checkpoint size")
        host = self.hosts[self.rank]
        need = 0
        for r, (n, h) in enumerate(table):
            need += n if h == host else 0
            src = self.source_of(r)
            linked = self.hosts[src] == self.hosts[r]
            need += table[src][0] if h == host and not linked else 0
        need *= STEPS_KEPT
        error = None
        if self.rank == min(r for r, (_, h) in enumerate(table) if h == host):
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize + _bytes_in(self.dir)  # ours are replaced
            if free < need:
                error = self._error(
                    self.root,
                    f"it has {free / 2**30:.2f} GiB free, and this host's ranks need "
                    f"{need / 2**30:.2f} GiB ({STEPS_KEPT} steps of their own copies of "
                    f"{nbytes / 2**20:.1f} MiB per rank and of the replicas they hold)",
                )
        try:
            self.ranks.agree(error)
        except CheckpointWriteError:
            with contextlib.suppress(OSError):
                os.rmdir(self.dir)  # made by this start, and empty unless a restart's
            raise

    def source_of(self, r: int) -> int:
        """The rank whose replica rank `r` holds."""
        shift = (self.rank - self.source) % self.world
        return (r - shift) % self.world

    # ------------------------------------------------------------------ save
    def save(self, step: int, consumed: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write this rank's copy of `tensors` after `step` and its replica at the peer;
        MemoryCheckpointError on every rank when a write fails on any."""
        meta = {
            "run_id": self.run_id,
            "step": step,
            "rank": self.rank,
            "world": self.world,
            "settings": self.settings,
            "consumed_samples": consumed,
        }
        own = os.path.join(self.dir, mf.own_name(self.rank, step))
        error = None
        try:
            self._prune(step)
            mf.write_copy(own, meta, tensors)
        except OSError as e:
            error = self._error(own, f"{type(e).__name__}: {e}")
        self.ranks.agree(error)
        self._replicate(step, own)

    def _prune(self, step: int) -> None:
        """Remove this rank's files (own and held) but the newest STEPS_KEPT - 1 before `step`."""
        mine = [
            (s, name)
            for owner, s, name in mf.listing(self.dir)
            if (owner == self.rank and name.startswith("rank"))
            or name.endswith(f".by{self.rank}.bin")
        ]
        keep = sorted({s for s, _ in mine if s < step}, reverse=True)[: STEPS_KEPT - 1]
        for s, name in mine:
            if s not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.dir, name))

    def _replicate(self, step: int, own: str) -> None:
        """The peer gets this rank's copy; this rank gets its source's (collective)."""
        send = self.hosts[self.peer] != self.hosts[self.rank]
        recv = self.hosts[self.source] != self.hosts[self.rank]
        dst = os.path.join(self.dir, mf.replica_name(self.source, step, self.rank))
        error = None
        try:
            if not recv:  # the source wrote its copy on this host: name it here too
                _link_or_copy(os.path.join(self.dir, mf.own_name(self.source, step)), dst)
        except OSError as e:
            error = self._error(dst, f"{type(e).__name__}: {e}")
        sizes = self.ranks.all_gather(os.path.getsize(own) if send else 0, "memory copy sizes")
        error = self._transfer(own if send else None, dst if recv else None, sizes) or error
        self.ranks.agree(error)

    def _transfer(self, own: str | None, dst: str | None, sizes: list[int]):
        """Send `own` to the peer and receive the source's copy into `dst`, chunk by chunk;
        returns this rank's write error, if any (the bytes are received regardless)."""
        data = mf.open_bytes(own) if own is not None else None
        n_in = sizes[self.source] if dst is not None else 0
        tmp = None if dst is None else os.path.join(self.dir, f".tmp-{os.path.basename(dst)}")
        error, f = None, None
        if tmp is not None:
            try:
                f = open(tmp, "wb")
            except OSError as e:
                error = self._error(tmp, f"{type(e).__name__}: {e}")
        buf = torch.empty(min(CHUNK, n_in), dtype=torch.uint8)
        n_out = 0 if data is None else data.numel()
        for i in range(max(-(-n_out // CHUNK), -(-n_in // CHUNK))):
            reqs = []
            if i * CHUNK < n_out:
                piece = data[i * CHUNK : (i + 1) * CHUNK]
                reqs.append(dist.isend(piece, self.peer, group=self.group, tag=i))
            if i * CHUNK < n_in:
                got = buf[: min(CHUNK, n_in - i * CHUNK)]
                reqs.append(dist.irecv(got, self.source, group=self.group, tag=i))
            guarded("memory checkpoint replica", self.group, lambda r=reqs: [q.wait() for q in r])
            if f is not None and i * CHUNK < n_in and error is None:
                try:
                    f.write(memoryview(got.numpy()))
                except OSError as e:
                    error = self._error(tmp, f"{type(e).__name__}: {e}")
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
            try:
                if error is None:
                    os.replace(tmp, dst)
            except OSError as e:
                error = self._error(dst, f"{type(e).__name__}: {e}")
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return error

    # ------------------------------------------------------------------ resume
    def _valid(self, owner: int, step: int, name: str) -> bool:
        try:
            header, _ = mf.read_header(os.path.join(self.dir, name))
        except (OSError, ValueError):
            return False
        want = {"run_id": self.run_id, "step": step, "rank": owner, "world": self.world}
        return (
            all(header.get(k) == v for k, v in want.items())
            and header.get("settings") == self.settings
        )

    def plan(self) -> Plan | None:
        """The newest step whose copy is complete for every rank (its own, or a replica on
        another rank), agreed in one all-gather of what each rank's host holds; None: none."""
        found = [
            (o, s, n, os.path.getsize(os.path.join(self.dir, n)))
            for o, s, n in mf.listing(self.dir)
            if o < self.world and self._valid(o, s, n)
        ]
        table = self.ranks.all_gather((self.hosts[self.rank], found), "memory checkpoint list")
        where: dict[tuple[int, int], dict[str, tuple[int, str, int]]] = {}
        for r, (host, files) in enumerate(table):
            for owner, step, name, size in files:
                where.setdefault((owner, step), {}).setdefault(host, (r, name, size))
        for step in sorted({s for _, s in where}, reverse=True):
            if all((o, step) in where for o in range(self.world)):
                sources = {}
                for o in range(self.world):
                    held = where[(o, step)]
                    own = held.get(table[o][0])  # a file on rank o's own host: read there
                    sources[o] = (o, *own[1:]) if own else min(held.values())
                return Plan(step, sources)
        return None

    def load(self, plan: Plan, targets: dict[str, torch.Tensor]) -> dict:
        """Fill `targets` (keyed as saved) from this rank's copy of `plan.step`: read here or
        received from the rank holding it -> the copy's header."""
        holder, name, size = plan.sources[self.rank]
        reqs = []
        for owner, (h, other, _) in sorted(plan.sources.items()):
            if h == self.rank and owner != self.rank:  # a replica this rank serves
                data = mf.open_bytes(os.path.join(self.dir, other))
                for i in range(0, data.numel(), CHUNK):
                    piece = data[i : i + CHUNK]
                    reqs.append(dist.isend(piece, owner, group=self.group, tag=i // CHUNK))
        if holder == self.rank:
            data = mf.open_bytes(os.path.join(self.dir, name))
        else:
            data = torch.empty(size, dtype=torch.uint8)
            for i in range(0, size, CHUNK):
                piece = data[i : i + CHUNK]
                reqs.append(dist.irecv(piece, holder, group=self.group, tag=i // CHUNK))
        guarded("memory checkpoint load", self.group, lambda: [q.wait() for q in reqs])
        header, head = mf.header_of_bytes(data)
        saved = mf.tensors_of(data, header, head)
        if set(saved) != set(targets):
            raise ValueError(f"holds {sorted(set(saved) ^ set(targets))[:4]} differently")
        with torch.no_grad():
            for key, t in targets.items():
                t.copy_(saved[key])
        return header

    def remove(self) -> None:
        """Remove this run's copies on this host (a clean end)."""
        self.ranks.barrier()
        shutil.rmtree(self.dir, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    tmp = os.path.join(os.path.dirname(dst), f".tmp-{os.path.basename(dst)}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _bytes_in(directory: str) -> int:
    """Bytes of the copies in `directory`, each file once (a linked replica shares its data)."""
    sizes = {}
    for _, _, name in mf.listing(directory):
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(directory, name))
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())
