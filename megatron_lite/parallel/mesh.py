"""Rank grid and process groups.

`RankLayout` is a pure function of (world size, degrees, order) that lists every group, so it is
unit-tested with golden tables and no processes. `ParallelMesh` creates the torch process groups
from it and exposes this rank's coordinates, sizes and groups.

Order is Megatron's: the first axis in `order` varies fastest, so with the default
`tp-cp-ep-dp-pp` TP groups are consecutive ranks (one NVLink node) and pipeline stages are far
apart. Expert parallelism folds into the dp×cp ranks: dense groups use the order without `ep`,
expert groups use it without `cp` with `dp` replaced by the expert-data-parallel degree
dp·cp/ep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Named groups: the axes they span in the dense or the expert grid.
DENSE_GROUPS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("cp", "dp"),
    "tp_pp": ("tp", "pp"),
    "tp_dp_cp": ("tp", "cp", "dp"),  # one pipeline stage: FP8 amax reduction
}
EXPERT_GROUPS = {"ep": ("ep",), "edp": ("dp",)}
COORD_GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")  # the rank map's columns


def _groups(world: int, sizes: dict[str, int], order: list[str], axes) -> np.ndarray:
    """Ranks that differ only along `axes` (first axis in `order` varies fastest): one row
    per group, int64 [groups, group size]."""
    # numpy is row-major (last index fastest), so lay the grid out in reversed order.
    grid = np.arange(world).reshape([sizes[a] for a in reversed(order)])
    names = list(reversed(order))
    keep = [names.index(a) for a in reversed([a for a in order if a in axes])]
    rest = [i for i in range(len(names)) if i not in keep]
    n = math.prod(sizes[a] for a in axes)
    return grid.transpose(rest + keep).reshape(-1, n)


def order_problem(order: str) -> str | None:
    """Why `order` is not a valid rank order, or None (the one owner of the order rules)."""
    tokens = order.split("-")
    if sorted(tokens) != sorted(AXES):
        return f"must name each of {', '.join(AXES)} once, joined by '-'"
    pos = sorted(tokens.index(a) for a in ("cp", "ep", "dp"))
    if pos[2] - pos[0] != 2:
        return "cp, ep and dp must be adjacent (experts fold into the dp×cp ranks)"
    return None


def expert_problem(ep: int, dp: int, cp: int) -> str | None:
    """Why `ep` cannot fold into the dp×cp ranks, or None."""
    if (dp * cp) % ep:
        return f"must divide dp·cp = {dp}·{cp} (experts spread over data/context ranks)"
    return None


@dataclass(frozen=True)
class RankLayout:
    """World size, degrees and order; `groups(name)` lists every group of that kind."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    # ranks of each CP group that run Ulysses' all-to-all together (parallel.cp_comm_type: a2a
    # all cp of them, p2p 1, a2a+p2p cp_a2a_size); the ring runs over the others. None = cp
    cp_a2a: int | None = None

    def __post_init__(self):
        problem = order_problem(self.order)
        if problem:
            raise ValueError(f"parallel.order={self.order!r} {problem}, e.g. {DEFAULT_ORDER!r}")
        mp = self.tp * self.pp * self.cp
        if self.world_size % mp:
            raise ValueError(f"world size {self.world_size} is not divisible by tp·pp·cp = {mp}")
        problem = expert_problem(self.ep, self.dp, self.cp)
        if problem:
            raise ValueError(f"parallel.ep={self.ep} {problem}")
        if self.cp % self.a2a:
            raise ValueError(f"cp_a2a={self.cp_a2a} must divide cp={self.cp}")

    @property
    def a2a(self) -> int:
        """Ulysses ranks per CP group's all-to-all group (the rest of cp is the ring)."""
        return self.cp if self.cp_a2a is None else self.cp_a2a

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    def _sizes(self, expert: bool) -> dict[str, int]:
        if expert:  # the expert grid: ep inside the dp×cp ranks, dp = expert-data-parallel
            return {"tp": self.tp, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def grid(self, axes: list[str]) -> list:
        """Nested lists of ranks indexed by `axes` reversed (slowest first): the dense grid when
        `axes` holds cp, the expert grid when it holds ep."""
        sizes = self._sizes(expert="ep" in axes)
        return np.arange(self.world_size).reshape([sizes[a] for a in reversed(axes)]).tolist()

    def group_array(self, name: str) -> np.ndarray:
        """`groups(name)` as an array [groups, group size] (not for "embedding"): vectorized
        questions about every group cost numpy time, not a Python list per rank."""
        tokens = self.order.split("-")
        if name in DENSE_GROUPS:
            dense = [a for a in tokens if a != "ep"]
            return _groups(self.world_size, self._sizes(False), dense, DENSE_GROUPS[name])
        if name in EXPERT_GROUPS:
            expert = [a for a in tokens if a != "cp"]
            return _groups(self.world_size, self._sizes(True), expert, EXPERT_GROUPS[name])
        raise KeyError(f"unknown group {name!r}")

    def groups(self, name: str) -> list[list[int]]:
        if name in DENSE_GROUPS or name in EXPERT_GROUPS:
            return self.group_array(name).tolist()
        if name == "embedding":  # first and last pipeline stage of each pipeline
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
        if name in ("cp_a2a", "cp_ring"):  # CP rank = ring rank · a2a + a2a rank (a2a inner)
            a, cp_groups = self.a2a, self.groups("cp")
            if name == "cp_a2a":
                return [g[j * a : (j + 1) * a] for g in cp_groups for j in range(len(g) // a)]
            return [g[i::a] for g in cp_groups for i in range(a)]
        raise KeyError(f"unknown group {name!r}")

    def group_names(self) -> list[str]:
        return [*DENSE_GROUPS, *EXPERT_GROUPS, "embedding"]

    def all_coords(self) -> list[dict[str, int]]:
        """Every rank's index inside each of its groups (tp, pp, ...), in O(world) time."""
        out = [{} for _ in range(self.world_size)]
        for name in COORD_GROUPS:
            for group in self.groups(name):
                for i, r in enumerate(group):
                    out[r][name] = i
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index inside each of its groups (tp_rank, pp_rank, ...)."""
        return self.all_coords()[rank]

    def rank_map(self) -> str:
        """Human-readable table: one line per rank with its coordinates."""
        lines = [
            f"rank map (order {self.order}; tp={self.tp} cp={self.cp} ep={self.ep} "
            f"dp={self.dp} pp={self.pp})"
        ]
        for r, c in enumerate(self.all_coords()):
            lines.append(
                f"  rank {r:3d}: tp {c['tp']} cp {c['cp']} dp {c['dp']} pp {c['pp']} "
                f"ep {c['ep']} edp {c['edp']}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class Group:
    """One kind of process group as this rank sees it."""

    name: str
    group: dist.ProcessGroup | None  # None when this rank is not a member (embedding group)
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this rank's index in `ranks`, -1 when not a member

    @property
    def size(self) -> int:
        return len(self.ranks)


class ParallelMesh:
    """Process groups for one rank, as typed fields. Every rank builds it in the same order.

    `tp`, `cp`, `dp`, `pp`: one axis each; `dp_cp`: dense-gradient reduction; `tp_pp`, `tp_dp_cp`
    (one pipeline stage: FP8 amax reduction); `ep`, `edp`: expert and expert-data-parallel;
    `embedding`: first and last pipeline stage (tied embeddings); `cp_a2a` and `cp_ring`: the
    Ulysses all-to-all and the ring inside each CP group (either may be the whole CP group or
    a single rank, `group` None). `device_mesh` is a torch
    `DeviceMesh` over the same groups with dims named by the dense axes, slowest first (pp, dp,
    cp, tp for the default order), for DTensor, DCP and FSDP2; `expert_device_mesh` likewise
    over (pp, edp, ep, tp).
    """

    layout: RankLayout
    rank: int
    tp: Group
    cp: Group
    cp_a2a: Group
    cp_ring: Group
    dp: Group
    pp: Group
    dp_cp: Group
    tp_pp: Group
    tp_dp_cp: Group
    ep: Group
    edp: Group
    embedding: Group
    device_mesh: DeviceMesh
    expert_device_mesh: DeviceMesh

    def __init__(self, layout: RankLayout, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs torch.distributed initialized first")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"layout is for {layout.world_size} ranks, world has {dist.get_world_size()}"
            )
        self.layout, self.rank = layout, dist.get_rank()
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        self.tp = self._new_groups("tp", kw)
        self.cp = self._new_groups("cp", kw)
        self.cp_a2a = self._cp_part("cp_a2a", layout.a2a, kw)
        self.cp_ring = self._cp_part("cp_ring", layout.cp // layout.a2a, kw)
        self.dp = self._new_groups("dp", kw)
        self.pp = self._new_groups("pp", kw)
        self.dp_cp = self._new_groups("dp_cp", kw)
        self.tp_pp = self._new_groups("tp_pp", kw)
        self.tp_dp_cp = self._new_groups("tp_dp_cp", kw)
        self.ep = self._new_groups("ep", kw)
        self.edp = self._new_groups("edp", kw)
        self.embedding = self._new_groups("embedding", kw)
        tokens = layout.order.split("-")
        self.device_mesh = self._device_mesh([a for a in tokens if a != "ep"], {"dp": "dp"})
        self.expert_device_mesh = self._device_mesh([a for a in tokens if a != "cp"], {"dp": "edp"})

    def _new_groups(self, name: str, kw: dict) -> Group:
        """Create every group of kind `name` (all ranks must, in the same order); keep ours."""
        mine = Group(name, None, (), -1)
        for ranks in self.layout.groups(name):
            g = dist.new_group(ranks, group_desc=name, **kw)
            if self.rank in ranks:
                mine = Group(name, g, tuple(ranks), ranks.index(self.rank))
        return mine

    def _cp_part(self, name: str, n: int, kw: dict) -> Group:
        """The CP group itself when it is all of it, this rank alone when n = 1, else new groups."""
        if n == self.cp.size:
            return Group(name, self.cp.group, self.cp.ranks, self.cp.rank)
        if n == 1:
            return Group(name, None, (self.rank,), 0)
        return self._new_groups(name, kw)

    def _device_mesh(self, axes: list[str], rename: dict[str, str]) -> DeviceMesh:
        """A DeviceMesh over our existing groups (no new communicators), slowest axis first."""
        names = [rename.get(a, a) for a in reversed(axes)]
        groups = [getattr(self, n) for n in names]
        grid = torch.tensor(self.layout.grid(axes))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return DeviceMesh.from_group(
            [g.group for g in groups], device, mesh=grid, mesh_dim_names=tuple(names)
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1
