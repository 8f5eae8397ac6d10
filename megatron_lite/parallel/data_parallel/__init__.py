"""Data parallelism: gradient buffers with overlapped bucketed reduction, and the distributed
optimizer (ZeRO-1/2, hybrid sharding, optimizer offload), see ddp.py; ZeRO-3 through FSDP2,
see fsdp.py."""

from megatron_lite.parallel.data_parallel.buffers import Bucket, GradBuffer
from megatron_lite.parallel.data_parallel.ddp import DataParallel
from megatron_lite.parallel.data_parallel.fsdp import FullyShardedDataParallel
from megatron_lite.parallel.data_parallel.optimizer import ShardedAdamW

__all__ = ["Bucket", "DataParallel", "FullyShardedDataParallel", "GradBuffer", "ShardedAdamW"]
