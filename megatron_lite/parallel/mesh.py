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
import torch.distributed as dist

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


def _groups(world: int, sizes: dict[str, int], order: list[str], axes) -> list[list[int]]:
    """Ranks that differ only along `axes` (first axis in `order` varies fastest)."""
    # numpy is row-major (last index fastest), so lay the grid out in reversed order.
    grid = np.arange(world).reshape([sizes[a] for a in reversed(order)])
    names = list(reversed(order))
    keep = [names.index(a) for a in reversed([a for a in order if a in axes])]
    rest = [i for i in range(len(names)) if i not in keep]
    n = math.prod(sizes[a] for a in axes)
    return grid.transpose(rest + keep).reshape(-1, n).tolist()


@dataclass(frozen=True)
class RankLayout:
    """World size, degrees and order; `groups(name)` lists every group of that kind."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        tokens = self.order.split("-")
        if sorted(tokens) != sorted(AXES):
            raise ValueError(
                f"parallel.order={self.order!r} must name each of {AXES} once, "
                f"e.g. {DEFAULT_ORDER!r}"
            )
        pos = sorted(tokens.index(a) for a in ("cp", "ep", "dp"))
        if pos[2] - pos[0] != 2:
            raise ValueError(
                f"parallel.order={self.order!r}: cp, ep and dp must be adjacent "
                "(experts fold into the dp×cp ranks), e.g. " + DEFAULT_ORDER
            )
        mp = self.tp * self.pp * self.cp
        if self.world_size % mp:
            raise ValueError(f"world size {self.world_size} is not divisible by tp·pp·cp = {mp}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide dp·cp = {self.dp * self.cp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    def groups(self, name: str) -> list[list[int]]:
        tokens = self.order.split("-")
        if name in DENSE_GROUPS:
            sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
            return _groups(
                self.world_size, sizes, [a for a in tokens if a != "ep"], DENSE_GROUPS[name]
            )
        if name in EXPERT_GROUPS:
            sizes = {"tp": self.tp, "ep": self.ep, "dp": self.edp, "pp": self.pp}
            return _groups(
                self.world_size, sizes, [a for a in tokens if a != "cp"], EXPERT_GROUPS[name]
            )
        if name == "embedding":  # first and last pipeline stage of each pipeline
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
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


class ParallelMesh:
    """Process groups for one rank. Must be built by every rank in the same order.

    Attributes: `layout`, `rank`, `<name>_group`, `<name>_rank`, `<name>_size` for each group
    name in `RankLayout.group_names()` (tp, cp, dp, pp, dp_cp, tp_pp, tp_dp_cp, ep, edp,
    embedding).
    """

    def __init__(self, layout: RankLayout, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs torch.distributed initialized first")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"layout is for {layout.world_size} ranks, world has {dist.get_world_size()}"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        for name in layout.group_names():
            mine, my_ranks = None, []
            for ranks in layout.groups(name):
                g = dist.new_group(ranks, group_desc=name, **kw)
                if self.rank in ranks:
                    mine, my_ranks = g, ranks
            setattr(self, f"{name}_group", mine)
            setattr(self, f"{name}_ranks", my_ranks)
            setattr(
                self, f"{name}_rank", my_ranks.index(self.rank) if self.rank in my_ranks else -1
            )
            setattr(self, f"{name}_size", len(my_ranks))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1
