"""The collectives of mappings.py as torch.compile sees them inside a compiled region
(model.compile: docs/performance.md).

Inside a region being traced (`torch.compiler.is_compiling()`) mappings.py's helpers call these
instead of the c10d ones: functional collectives (`torch.distributed._functional_collectives`),
which dynamo traces into the graph (out of place; the wait is explicit, so inductor may move
independent compute across it on a GPU) with no graph break. Their payloads are counted in
`comm_stats.STATS` by `record`, a call dynamo replays after the compiled graph each time it
runs (torch's reorderable logging functions: the counters are never read while tracing, so no
guard is installed on them and the counts are per call, as in eager).

A failure or timeout inside a compiled graph surfaces from the graph's wait, not through
mappings' CollectiveError: the compiled path trades that message for an unbroken graph.
"""

from __future__ import annotations

import torch

from megatron_lite.parallel.comm_stats import STATS


def compiling() -> bool:
    """Whether the caller is being traced by torch.compile (dynamo)."""
    return torch.compiler.is_compiling()


def _record_eager(kind: str, group_name: str, op: str, n: int, numel: int, dtype) -> None:
    STATS.record(kind, torch.empty(numel, dtype=dtype, device="meta"), group_name, op=op, n=n)


# the replayed recorder: _record_eager under torch.compiler.disable (dynamo must not trace the
# replayed call itself: it would guard on the counters' values), made by enable_stats_replay
# once per process (not at import: torch.compiler.disable loads dynamo, ~1 s)
_REPLAYED: list = []


def enable_stats_replay() -> None:
    """Let compiled regions count their collectives (the module docstring): registers the
    recorder as a reorderable logging function, torch's one hook for that (a private config)."""
    if not _REPLAYED:
        _REPLAYED.append(torch.compiler.disable(_record_eager))
        torch._dynamo.config.reorderable_logging_functions.add(_REPLAYED[0])


def record(kind: str, op: str, t: torch.Tensor, group) -> None:
    """Count collective `op` of `kind` with per-rank payload `t` over `group` (as STATS.record)."""
    import torch.distributed as dist

    name = getattr(group, "group_desc", "world")
    if _REPLAYED:  # a region compiled without enable_stats_replay counts nothing
        _REPLAYED[0](kind, name, op, dist.get_world_size(group), t.numel(), t.dtype)


def all_reduce(t: torch.Tensor, group, op: str = "sum", kind: str = "all_reduce"):
    """A new tensor: the reduction (`sum` or `max`) of t over `group`."""
    from torch.distributed import _functional_collectives as funcol

    record(kind, "all_reduce", t, group)
    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


def all_gather_dim0(t: torch.Tensor, group, kind: str = "all_gather") -> torch.Tensor:
    """[n, ...] -> [n·size, ...] in rank order."""
    from torch.distributed import _functional_collectives as funcol

    record(kind, "all_gather", t, group)
    return funcol.wait_tensor(funcol.all_gather_tensor(t.contiguous(), 0, group))


def reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """[n·size, ...] -> [n, ...]: the sum over ranks of this rank's chunk."""
    from torch.distributed import _functional_collectives as funcol

    record("reduce_scatter", "reduce_scatter", t, group)
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t.contiguous(), "sum", 0, group))


def all_to_all_single(t: torch.Tensor, group) -> torch.Tensor:
    """Even all_to_all_single along dim 0: chunk i of t goes to rank i."""
    from torch.distributed import _functional_collectives as funcol

    record("all_to_all", "all_to_all", t, group)
    return funcol.wait_tensor(funcol.all_to_all_single(t.contiguous(), None, None, group))
