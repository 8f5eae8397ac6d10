"""The collectives of mappings.py as torch.compile sees them inside a compiled region
(model.compile: docs/compile.md).

Inside a region being traced (`torch.compiler.is_compiling()`) mappings.py's helpers call these
instead of the c10d ones: functional collectives (`torch.distributed._functional_collectives`),
which dynamo traces into the graph (out of place; the wait is explicit, so inductor may move
independent compute across it on a GPU) with no graph break. They are not counted in
`comm_stats.STATS`: a counting call replayed after the graph (torch's reorderable logging
functions) is dropped by dynamo (torch 2.13) when made from an inlined function, as every
collective here is, so a compiled run's comm_bytes/* miss the collectives inside its regions
(the eager parts and the data-parallel ones still count).

A failure or timeout inside a compiled graph surfaces from the graph's wait, not through
mappings' CollectiveError: the compiled path trades that message for an unbroken graph.
"""

from __future__ import annotations

import torch


def compiling() -> bool:
    """Whether the caller is being traced by torch.compile (dynamo)."""
    return torch.compiler.is_compiling()


def all_reduce(t: torch.Tensor, group, op: str = "sum"):
    """A new tensor: the reduction (`sum` or `max`) of t over `group`."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


def all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] -> [n·size, ...] in rank order."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_tensor(t.contiguous(), 0, group))


def reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """[n·size, ...] -> [n, ...]: the sum over ranks of this rank's chunk."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t.contiguous(), "sum", 0, group))


def all_to_all_single(t: torch.Tensor, group) -> torch.Tensor:
    """Even all_to_all_single along dim 0: chunk i of t goes to rank i."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single(t.contiguous(), None, None, group))
