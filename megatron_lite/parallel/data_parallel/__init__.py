"""Data parallelism: gradient buffers with overlapped bucketed reduction, and the distributed
optimizer (ZeRO-1/2, hybrid sharding, optimizer offload). See ddp.py."""

from megatron_lite.parallel.data_parallel.buffers import Bucket, GradBuffer
from megatron_lite.parallel.data_parallel.ddp import DataParallel
from megatron_lite.parallel.data_parallel.optimizer import ShardedAdamW

__all__ = ["Bucket", "DataParallel", "GradBuffer", "ShardedAdamW"]
