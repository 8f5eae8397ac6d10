"""Pipeline parallelism: schedules as data (one registered `ScheduleSpec` record each), their
simulator, P2P and the engine that runs them.

The function `simulate` is not re-exported here: that name stays the module
`megatron_lite.pipeline.simulate` (use `from megatron_lite.pipeline.simulate import simulate`).
"""

from megatron_lite.pipeline.engine import PipelineStats, forward_backward
from megatron_lite.pipeline.registry import (
    ScheduleSpec,
    get_schedule_spec,
    register_schedule,
    schedule_names,
)
from megatron_lite.pipeline.schedules import (
    Action,
    comm_batches,
    format_actions,
    get_schedule,
    get_schedule_table,
    interleaved_one_f_one_b,
    no_pipelining,
    one_f_one_b,
    peer_of,
    virtual_stage,
)
from megatron_lite.pipeline.simulate import (
    DeadlockError,
    ScheduleError,
    SimResult,
    Span,
    chrome_trace,
    timeline,
)

__all__ = [
    "Action",
    "DeadlockError",
    "PipelineStats",
    "ScheduleSpec",
    "ScheduleError",
    "SimResult",
    "Span",
    "chrome_trace",
    "comm_batches",
    "format_actions",
    "forward_backward",
    "get_schedule",
    "get_schedule_spec",
    "get_schedule_table",
    "interleaved_one_f_one_b",
    "no_pipelining",
    "one_f_one_b",
    "peer_of",
    "register_schedule",
    "schedule_names",
    "timeline",
    "virtual_stage",
]
