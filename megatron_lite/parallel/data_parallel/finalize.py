"""Gradient finalization after the last backward of a step, the global grad norm and clipping:
the one owner for every path (`DataParallel`, `FullyShardedDataParallel`, and `finalize_grads`
for a plain torch optimizer).

Reads each parameter's `meta` (see parallel/params.py):
- dense grads: sum over dp×cp; expert grads: sum over expert-data-parallel (the wrappers do
  this in their buckets or FSDP2; `finalize_grads` with one all-reduce per group);
- sequence-parallel replicas (SP norms, row-parallel biases, learned positions added to a
  sequence shard): sum over TP;
- tied embedding copies: sum over the embedding group (first and last pipeline stage).
The loss is already divided by the global token count, so sums (not means) are right.

The two model-parallel sums act on whatever local tensors the caller holds (whole grads, a
ZeRO shard, an FSDP2 local shard): every TP rank (every holder of the tied weight) shards its
gradients alike, so their local tensors cover the same elements.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from megatron_lite.parallel import mappings
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import ParamMeta, meta_of


@dataclass(frozen=True)
class LocalGrad:
    """One local gradient tensor of `param`: the whole gradient, a ZeRO shard or a piece of one
    (any shape), and how many ranks of its data-parallel group hold an identical copy."""

    param: torch.nn.Parameter
    grad: torch.Tensor
    data_replicas: int


def data_replicas(group_size: int, shard_size: int) -> int:
    """Ranks of a data-parallel group of `group_size` holding an identical copy of a reduced
    gradient element, when the group shards it over `shard_size` ranks (1: replicated, the
    whole group; the whole group: 1; hybrid sharding: the number of shard groups)."""
    return group_size // shard_size


def identical_copies(meta: ParamMeta, data_replicas: int, tp_size: int) -> int:
    """How many ranks hold an identical copy of a parameter's local elements, for counting each
    element once in the global gradient norm: its data-parallel replicas, times TP when it is
    not TP-sharded (experts: tp_dim is the EP shard dim); 0 for the tied last-stage copy,
    which the first stage already counts."""
    if meta.tied_copy:
        return 0
    if meta.tp_dim is None or meta.is_expert:
        return data_replicas * tp_size
    return data_replicas


def tied_params(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The input embedding (the parameter named `embedding.weight` in its chunk) and its
    last-stage copy (marked `tied_copy`): the weights summed over the embedding group."""
    out = []
    for c in chunks:
        for name, p in c.named_parameters():
            if meta_of(p).tied_copy or name == "embedding.weight":
                out.append(p)
    return out


@torch.no_grad()
def sum_model_parallel_copies(
    grads: Sequence[LocalGrad], mesh: ParallelMesh, tied: Collection[torch.nn.Parameter]
) -> None:
    """Sum the sequence-parallel replicas over TP and the grads of `tied` over the embedding
    group, in place, one flat all-reduce each (no-ops on groups of one rank). A rank holding
    both the embedding and its copy (the V placement of zb-v puts the first and the last
    virtual stage on pipeline rank 0) adds the two here: the group's other ranks hold none."""
    sp = [g.grad for g in grads if meta_of(g.param).sequence_parallel]
    mappings.all_reduce_flat(sp, mesh.tp.group)
    ids = {id(p) for p in tied}
    local = [g.grad for g in grads if id(g.param) in ids]
    if len(ids) == 2:  # the embedding and its copy, here: equal shapes and shards
        if local:
            local[0].add_(local[1])
            local[1].copy_(local[0])
        return
    mappings.all_reduce_flat(local, mesh.embedding.group)


@torch.no_grad()
def grad_square_sum(grads: Iterable[LocalGrad], tp_size: int, device) -> torch.Tensor:
    """This rank's share of the global Σg² (fp64 scalar on `device`): each local element
    divided by the number of ranks holding an identical copy (`identical_copies`), so the sum
    over the world (the caller's all-reduce) counts every element of the model once."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        n = identical_copies(meta_of(g.param), g.data_replicas, tp_size)
        if n:
            total += torch.linalg.vector_norm(g.grad, dtype=torch.float64).square() / n
    return total


@torch.no_grad()
def scale_to_max_norm(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale every tensor by max_norm / norm when the global norm exceeds max_norm (> 0;
    max_norm <= 0 disables clipping)."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


# ------------------------------------------------------------ for a plain torch optimizer
def _local_grads(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> list[LocalGrad]:
    """Whole grads, replicated over their data-parallel group (dp×cp, or edp for experts)."""
    return [
        LocalGrad(p, p.grad, mesh.edp.size if meta_of(p).is_expert else mesh.dp_cp.size)
        for p in params
    ]


@torch.no_grad()
def finalize_grads(
    params: list[torch.nn.Parameter],
    mesh: ParallelMesh,
    tie_embeddings: bool = False,
    embedding_param: torch.nn.Parameter | None = None,
) -> None:
    """Make `p.grad` of every parameter in `params` (this rank's, after the step's last
    backward) the full-batch gradient, for a plain torch optimizer: missing grads become zeros;
    SP replicas summed over TP; with tie_embeddings on pp > 1, `embedding_param` (first stage)
    and the `tied_copy` parameters (last stage) over the embedding group; dense grads over
    dp×cp and expert grads over expert-data-parallel."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    tied = []
    if tie_embeddings and mesh.pp.size > 1:
        tied = [p for p in params if meta_of(p).tied_copy or p is embedding_param]
    sum_model_parallel_copies(_local_grads(params, mesh), mesh, tied)
    mappings.all_reduce_flat([p.grad for p in params if not meta_of(p).is_expert], mesh.dp_cp.group)
    mappings.all_reduce_flat([p.grad for p in params if meta_of(p).is_expert], mesh.edp.group)


def local_grad_square_sum(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """This rank's share of the global Σg² (fp64 scalar) after `finalize_grads`; all-reduce it
    over the world (`dist.all_reduce`) and take the square root for the global grad norm."""
    return grad_square_sum(_local_grads(params, mesh), mesh.tp.size, params[0].device)


def clip_grads(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every `p.grad` by max_norm / norm when the global norm exceeds max_norm (> 0)."""
    scale_to_max_norm([p.grad for p in params], norm, max_norm)
