"""Gradient finalization after the last backward of a step, and grad-norm clipping.

Reads each parameter's `meta` (see parallel/params.py):
- sequence-parallel replicas (SP norms, row-parallel biases, GPT positions): sum over TP;
- tied embedding copies: sum over the embedding group (first and last pipeline stage);
- dense grads: sum over dp×cp; expert grads: sum over expert-data-parallel.
The loss is already divided by the global token count, so sums (not means) are right.
"""

from __future__ import annotations

import torch

from megatron_lite.parallel import mappings
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import meta_of, square_sum_share


@torch.no_grad()
def finalize_grads(
    params: list[torch.nn.Parameter],
    mesh: ParallelMesh,
    tie_embeddings: bool,
    embedding_param: torch.nn.Parameter | None,
) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    mappings.all_reduce_flat(
        [p.grad for p in params if meta_of(p).sequence_parallel], mesh.tp.group
    )
    if tie_embeddings and mesh.pp.size > 1:
        tied = [p for p in params if meta_of(p).tied_copy or p is embedding_param]
        mappings.all_reduce_flat([p.grad for p in tied], mesh.embedding.group)
    mappings.all_reduce_flat([p.grad for p in params if not meta_of(p).is_expert], mesh.dp_cp.group)
    mappings.all_reduce_flat([p.grad for p in params if meta_of(p).is_expert], mesh.edp.group)


@torch.no_grad()
def local_grad_square_sum(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """This rank's share of the global Σg² (fp64 scalar); summed over the world it counts every
    element once: each rank divides by how many ranks hold an identical copy of that element
    (dp·cp replicas, TP replicas of unsharded params; the tied embedding's last-stage copy
    counts zero times)."""
    entries = []
    for p in params:
        meta = meta_of(p)
        entries.append((meta, p.grad, mesh.edp.size if meta.is_expert else mesh.dp_cp.size))
    return square_sum_share(entries, mesh.tp.size, params[0].device)


@torch.no_grad()
def clip_grads(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every grad by max_norm / norm when the global norm exceeds max_norm (> 0)."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([p.grad for p in params], max_norm / (norm + 1e-6))
