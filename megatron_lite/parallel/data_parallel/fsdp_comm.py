"""FSDP2's all-gathers and reduce-scatters, counted in comm_stats and guarded like our own
collectives.

The one place that touches a private torch API (FSDP2's default collective classes, used
through the public `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`): the
subclasses record the payload (an all-gather counts its input shard, a reduce-scatter its
full input, as parallel/mappings.py does), call the default, and turn a failure or timeout
(gloo raises it from the call, or from the wait of an async one) into the CollectiveError that
names rank, step, op and group, so a ZeRO-3 hang ends in the hang dump like any other
(training/hang_dump.py). Where the classes are missing (another torch version) nothing is
counted and `count_collectives` returns False.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.mappings import recorded

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
except ImportError:  # pragma: no cover - torch versions without them
    DefaultAllGather = DefaultReduceScatter = None


def _group_name(group) -> str:
    return getattr(group, "group_desc", "fsdp")


class GuardedWork(dist.Work):
    """An async FSDP2 collective's work (FSDP2 checks for a `dist.Work`): its wait raises
    the CollectiveError of a failure or timeout."""

    def __init__(self, work: dist.Work, kind: str, group, shape: tuple):
        super().__init__()
        self.work, self.kind, self.group, self.shape = work, kind, group, shape

    def wait(self, timeout=None) -> bool:
        wait = self.work.wait if timeout is None else lambda: self.work.wait(timeout)
        return recorded(self.kind, self.group, wait, self.shape)


def _guarded(kind: str, tensor, group, call):
    """Record `kind` (op: its collective), run `call()` guarded; wrap the work it returns."""
    op = kind.removesuffix("_fsdp")
    STATS.record(kind, tensor, _group_name(group), op=op, n=group.size())
    shape = tuple(tensor.shape)
    work = recorded(kind, group, call, shape)
    return GuardedWork(work, kind, group, shape) if isinstance(work, dist.Work) else work


if DefaultAllGather is not None:

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            call = super().__call__
            return _guarded(
                "all_gather_fsdp",
                input_tensor,
                group,
                lambda: call(output_tensor, input_tensor, group, async_op),
            )

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            call = super().__call__
            return _guarded(
                "reduce_scatter_fsdp",
                input_tensor,
                group,
                lambda: call(output_tensor, input_tensor, group, op, async_op),
            )


def count_collectives(module) -> bool:
    """Make an FSDP2 module report its collectives to comm_stats and raise CollectiveError on
    a failure or timeout; False where it cannot."""
    if DefaultAllGather is None or not hasattr(module, "set_custom_all_gather"):
        return False
    module.set_custom_all_gather(CountingAllGather())
    module.set_custom_reduce_scatter(CountingReduceScatter())
    return True
