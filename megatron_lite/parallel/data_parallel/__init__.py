"""Data parallelism for any model built from our blocks: `build_data_parallel(chunks, mesh,
zero_stage=..., ...)` returns a `DataParallelWrapper` (interface.py; builder.py documents the
arguments): gradient buffers with overlapped bucketed reduction and the distributed optimizer
(ZeRO-1/2, hybrid sharding, optimizer offload, see ddp.py), or ZeRO-3 through FSDP2 (fsdp.py).
The optimizer is an `OptimizerSpec` (optimizer_spec.py: `register_optimizer` adds one).
For a plain torch optimizer, `finalize_grads`, `local_grad_square_sum` and `clip_grads`
(finalize.py, which owns the gradient finalization of every path). Bad arguments raise
`DataParallelArgumentError` (arguments.py) before any group is used; the rules are rules.py's,
which the config path shares."""

from typing import TYPE_CHECKING

from megatron_lite.lazy import lazy_exports

# name -> module: loaded on first use, so that importing the argument rules (rules.py, which
# config validation reads in every CLI process) does not load the wrappers, FSDP2 and DTensor
_EXPORTS = {
    "Bucket": "buffers",
    "DataParallel": "ddp",
    "DataParallelArgumentError": "arguments",
    "DataParallelOptimizer": "interface",
    "DataParallelWrapper": "interface",
    "FullyShardedDataParallel": "fsdp",
    "GradBuffer": "buffers",
    "OptimizerSpec": "optimizer_spec",
    "ParamGroup": "optimizer_spec",
    "ShardedOptimizer": "optimizer",
    "StateShard": "interface",
    "StateSpec": "optimizer_spec",
    "build_data_parallel": "builder",
    "clip_grads": "finalize",
    "finalize_grads": "finalize",
    "get_optimizer": "optimizer_spec",
    "local_grad_square_sum": "finalize",
    "optimizer_names": "optimizer_spec",
    "register_optimizer": "optimizer_spec",
}
__all__ = [
    "Bucket",
    "DataParallel",
    "DataParallelArgumentError",
    "DataParallelOptimizer",
    "DataParallelWrapper",
    "FullyShardedDataParallel",
    "GradBuffer",
    "OptimizerSpec",
    "ParamGroup",
    "ShardedOptimizer",
    "StateShard",
    "StateSpec",
    "build_data_parallel",
    "clip_grads",
    "finalize_grads",
    "get_optimizer",
    "local_grad_square_sum",
    "optimizer_names",
    "register_optimizer",
]

if TYPE_CHECKING:
    from megatron_lite.parallel.data_parallel.arguments import DataParallelArgumentError
    from megatron_lite.parallel.data_parallel.buffers import Bucket, GradBuffer
    from megatron_lite.parallel.data_parallel.builder import build_data_parallel
    from megatron_lite.parallel.data_parallel.ddp import DataParallel
    from megatron_lite.parallel.data_parallel.finalize import (
        clip_grads,
        finalize_grads,
        local_grad_square_sum,
    )
    from megatron_lite.parallel.data_parallel.fsdp import FullyShardedDataParallel
    from megatron_lite.parallel.data_parallel.interface import (
        DataParallelOptimizer,
        DataParallelWrapper,
        StateShard,
    )
    from megatron_lite.parallel.data_parallel.optimizer import ShardedOptimizer
    from megatron_lite.parallel.data_parallel.optimizer_spec import (
        OptimizerSpec,
        ParamGroup,
        StateSpec,
        get_optimizer,
        optimizer_names,
        register_optimizer,
    )


__getattr__ = lazy_exports(__name__, _EXPORTS)
