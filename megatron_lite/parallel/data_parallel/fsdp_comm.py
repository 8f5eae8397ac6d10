"""FSDP2's all-gathers and reduce-scatters, counted in comm_stats like our own collectives.

The one place that touches a private torch API (FSDP2's default collective classes, used
through the public `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`): the
subclasses only record the payload (an all-gather counts its input shard, a reduce-scatter its
full input, as parallel/mappings.py does) and call the default. Where the classes are missing
(another torch version) nothing is counted and `count_collectives` returns False.
"""

from __future__ import annotations

from megatron_lite.parallel.comm_stats import STATS

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
except ImportError:  # pragma: no cover - torch versions without them
    DefaultAllGather = DefaultReduceScatter = None


def _group_name(group) -> str:
    return getattr(group, "group_desc", "fsdp")


if DefaultAllGather is not None:

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            STATS.record(
                "all_gather_fsdp", input_tensor, _group_name(group), op="all_gather", n=group.size()
            )
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            STATS.record(
                "reduce_scatter_fsdp",
                input_tensor,
                _group_name(group),
                op="reduce_scatter",
                n=group.size(),
            )
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def count_collectives(module) -> bool:
    """Make an FSDP2 module report its collectives to comm_stats; False where it cannot."""
    if DefaultAllGather is None or not hasattr(module, "set_custom_all_gather"):
        return False
    module.set_custom_all_gather(CountingAllGather())
    module.set_custom_reduce_scatter(CountingReduceScatter())
    return True
