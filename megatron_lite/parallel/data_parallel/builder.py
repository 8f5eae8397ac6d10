"""`build_data_parallel`: data parallelism and an optimizer (AdamW by default) for any model
built from our blocks, from plain arguments (no Config). The trainer's
`training.optimizer.build_data_parallel(chunks, mesh, cfg)` is this call with the config's
fields."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from megatron_lite.parallel.data_parallel import arguments
from megatron_lite.parallel.data_parallel.ddp import DataParallel
from megatron_lite.parallel.data_parallel.fsdp import FullyShardedDataParallel
from megatron_lite.parallel.data_parallel.interface import DataParallelWrapper
from megatron_lite.parallel.data_parallel.optimizer_spec import OptimizerSpec
from megatron_lite.parallel.mesh import ParallelMesh


def build_data_parallel(
    chunks: Sequence[torch.nn.Module],
    mesh: ParallelMesh,
    *,
    zero_stage: int = 0,
    optimizer: str | OptimizerSpec = "adamw",
    lr: float = 1e-3,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float = 0.0,
    optimizer_args: dict | None = None,
    dp_shard: int | None = None,
    bucket_size: int = 40_000_000,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    grad_reduce_dtype: torch.dtype = torch.float32,
    offload: bool | str = False,
    nvme_path: str | None = None,
    nvme_buffer_mb: int = 1024,
    reshard_after_forward: bool = True,
    zero3_grad_reduce: str = "step",
    tie_embeddings: bool = False,
    layers_of: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
    device: torch.device | str | None = None,
) -> DataParallelWrapper:
    """Gradient reduction and the optimizer for this rank's model `chunks` (one per virtual pipeline
    stage; their parameters carry our sharding metadata, see parallel/params.py), over the
    data-parallel groups of `mesh` (dense: dp×cp, experts: expert-data-parallel).

    zero_stage: 0 replicated optimizer (all-reduce); 1 optimizer states and fp32 masters
        sharded (reduce-scatter, weights all-gathered after the step); 2 also the gradients
        between steps; 3 also the weights, through FSDP2 (one unit per layer, see `layers_of`).
        An optimizer whose update needs whole matrices (Muon's) gives each such parameter
        to one owner rank (whole_matrix.py; stage 3: fsdp_whole_matrix.py).
    optimizer: an `OptimizerSpec` or a registered name (optimizer_spec.py; default "adamw";
        "muon": Muon for the hidden matrices, AdamW for the rest, muon.py).
    lr, betas, eps, weight_decay: its hyperparameters of those names (betas, eps: None for
        the spec's defaults; AdamW's are (0.9, 0.95), 1e-8); optimizer_args: its others by
        name. AdamW's weight decay applies to matrices only (parameters with dim >= 2), not
        to norms, biases or other 1-D parameters (its groups rule). The trainer sets `lr` in
        `optimizer.param_groups` every step for a schedule.
    dp_shard: hybrid sharding: shard within blocks of dp_shard ranks of the group, all-reduce
        the shards across the blocks (stages 1-3; None: shard over the whole group).
    bucket_size: elements per gradient bucket (stages 0-2); overlap_grad_reduce: reduce a
        bucket as soon as its gradients are final, during the backward; overlap_param_gather:
        the weight all-gather after the step overlaps the next forward (stages 1-2).
    grad_reduce_dtype: the dtype gradients travel in, torch.float32 or torch.bfloat16
        (bf16 halves the bytes; they accumulate and the optimizer steps in fp32 either way).
        The config's strings "fp32"/"bf16" are not accepted here: pass the torch.dtype.
    offload: optimizer states and fp32 masters off the device, stepped on the host (stages
        0-2): False (none), "cpu" (or True: in host memory) or "nvme" (in a swap file under
        `nvme_path`, an existing writable directory, read in group by group through a host
        buffer of `nvme_buffer_mb` MiB, which must hold the largest piece's state; nvme.py,
        docs/offload.md). Stage 3 refuses both.
    reshard_after_forward: stage 3: free each layer's gathered weights after its forward.
    zero3_grad_reduce: stage 3 with several microbatches: "step" reduce-scatters once per step
        (unsharded gradients kept between microbatches), "microbatch" once per microbatch
        (only the shards kept; fsdp.py).
    tie_embeddings: with pp > 1, sum the input embedding (the parameter named
        `embedding.weight` in the first stage's chunk) and its last-stage copy (marked
        `set_meta(..., tied_copy=True)`) over the embedding group.
    layers_of: stage 3: `layers_of(chunk)` lists the chunk's transformer layers, each its own
        FSDP2 unit (the rest of the chunk is one more); default `chunk.layers.values()`.
    device: stage 3 with chunks on the meta device: they are sharded there and each rank's
        shards get uninitialized storage on `device` (fill them with
        `params.init_parameters` or a load; recompute buffers that were on meta).

    The weights compute in the dtype the parameters have, fp32 or bf16 (cast the model to
    bf16 first for bf16 weights; fp16 is refused: it needs loss scaling, which nothing here
    does); the optimizer keeps fp32 masters. Every argument is checked first, before any
    group or mesh is used, by the rules the config path shares (rules.py, arguments.py): a bad
    one raises `DataParallelArgumentError` (a ValueError) naming it, its value, the rule and a
    fix. lr, betas, eps and weight_decay are checked in fp32, the dtype AdamW holds them in
    (lr=1e39 is inf there), and lr·weight_decay must stay below 1.

    Returns a `DataParallelWrapper`: call `start_step`, `finish_grad_sync`, `grad_square_sum`,
    `clip`, `step` around each step's forward and backward (interface.py). Under stage 3 the
    chunks' parameters are replaced by sharded ones: read them from the chunks after this call.
    """
    args = dict(optimizer=optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                optimizer_args=optimizer_args)  # fmt: skip
    common = dict(dp_shard=dp_shard, tie_embeddings=tie_embeddings, **args)
    dp_args = dict(bucket_size=bucket_size, overlap_grad_reduce=overlap_grad_reduce,
                   overlap_param_gather=overlap_param_gather, offload=offload,
                   nvme_path=nvme_path, nvme_buffer_mb=nvme_buffer_mb)  # fmt: skip
    fsdp_args = dict(reshard_after_forward=reshard_after_forward, layers_of=layers_of)
    arguments.check_arguments(
        "build_data_parallel",
        chunks,
        mesh,
        dict(zero_stage=zero_stage, grad_reduce_dtype=grad_reduce_dtype, device=device,
             **common, **dp_args, **fsdp_args),
    )  # fmt: skip
    dtype = arguments.weights_dtype(chunks)
    if zero_stage == 3:
        return FullyShardedDataParallel(
            list(chunks),
            mesh,
            param_dtype=dtype,
            reduce_dtype=grad_reduce_dtype,
            device=device,
            grad_reduce=zero3_grad_reduce,
            **common,
            **fsdp_args,
        )
    return DataParallel(
        list(chunks),
        mesh,
        zero_stage=zero_stage,
        grad_reduce_dtype=grad_reduce_dtype,
        **common,
        **dp_args,
    )
