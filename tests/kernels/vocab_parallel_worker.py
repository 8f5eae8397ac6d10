"""The per-rank body of the 2-rank cross-entropy test, in a module that does not import triton.

The ranks fork from a forkserver that has only torch loaded; importing triton here, after
TRITON_INTERPRET is set, lets the Triton path run in the interpreter even on a machine where
the test process itself imported triton for a GPU.
"""

import importlib
import os

import torch

IGNORE = -100


def vocab_parallel_rank(rank, world, backend, logits, target, dloss):
    """One rank of a TP group: loss and grad of its vocab shard, plus the collective volume."""
    os.environ["MEGATRON_LITE_KERNELS"] = backend
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors: the Triton path needs the interpreter
    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy

    importlib.import_module("megatron_lite.kernels.cross_entropy").BLOCK_V = 8  # several chunks
    v_local = logits.shape[1] // world
    shard = logits[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    STATS.start_step(0)
    group = torch.distributed.group.WORLD
    loss = vocab_parallel_cross_entropy(shard, target, group, ignore_index=IGNORE)
    forward_elements = sum(STATS.elements.values())
    (dshard,) = torch.autograd.grad(loss, shard, dloss)
    backward_elements = sum(STATS.elements.values()) - forward_elements
    # plain lists: tensors would travel through shared memory that dies with the child
    return loss.tolist(), dshard.tolist(), forward_elements, backward_elements
