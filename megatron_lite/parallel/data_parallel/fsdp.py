"""`FullyShardedDataParallel`: ZeRO stage 3 through torch FSDP2 (`fully_shard`), with hybrid
sharding (HSDP), for one rank's model chunks. Same methods as `DataParallel`, so the trainer
and the checkpoints do not know which stage runs.

Units: `fully_shard` per transformer layer (each module of a chunk's `layers`), the expert
modules inside them and anywhere else in the chunk (their own unit, on the expert-data-parallel
mesh), then the chunk root (embedding, final norm, output layer, and the rest outside the
layers: the MTP modules' dense parameters). Each unit's parameters are sharded over the
gradient's reduction group, dp×cp for dense parameters and edp for experts, as a 1-D
`DeviceMesh`, or with `dp_shard` a 2-D (replicate, shard) mesh: shard within blocks of dp_shard
ranks, all-reduce the shards across the blocks. Our TP/EP shards are plain local tensors; FSDP2
shards them further along dim 0. The sharded fp32 parameters are the master weights;
`param_dtype` is what the gathered weights compute in (bf16 under train.precision=bf16),
`reduce_dtype` the gradient reduction's.

Chunks built on the meta device (no storage) are sharded there, then each rank's shards alone
get uninitialized storage on `device`: the whole model never exists on one rank, so the memory
of building it falls as 1/N. Fill them with `params.init_parameters` (each rank draws its own
rows) or a checkpoint load, and recompute the buffers that were on meta.

Gradients are summed (the loss is already the mean over the global batch). Over microbatches,
`grad_reduce` picks where they accumulate (config: parallel.zero3_grad_reduce):
- "step" (default): unsharded, in `reduce_dtype`, without communication: each chunk
  reduce-scatters once, in the backward of the step's last microbatch. Which backward that is,
  the pipeline engine knows from its schedule table: it calls `before_backward(chunk, is_last)`
  before running each backward, outside autograd, and that sets FSDP2's flags (a backward
  nobody announced syncs, as FSDP2 does by default: correct, one reduce-scatter per
  microbatch). So with M > 1 microbatches a rank holds the unsharded gradients of its whole
  model (Ψ in the reduce dtype) from the first microbatch's backward to the last's, beside the
  4Ψ/N shards: one reduce-scatter per step instead of M, for that memory.
- "microbatch": every backward reduce-scatters (FSDP2's default, TorchTitan's and DeepSpeed's
  with accumulation), each unit right after its gradients are complete; FSDP2 adds the reduced
  shards into the sharded parameter's fp32 `.grad` (the masters' dtype), so between
  microbatches a rank keeps Ψ/N·4 bytes of gradient shards and no unsharded gradient; during a
  backward one unit's unsharded gradients at a time, until its reduce-scatter. M reduce-scatters
  per step instead of 1 (each overlaps the rest of its backward). Every backward is also FSDP2's
  "last" (`set_is_last_backward(True)`, its default): its end-of-backward callback drops the
  last reduce-scatter's flat input, which otherwise lives to the next backward (the dry run
  measured the chunk root's, embedding and output layer: 2 GiB of Llama-3 8B at tp2, through
  the next forward).
memory.py and the planner count what each keeps. Then, as in `DataParallel`,
sequence-parallel replicas are summed over TP and the tied embedding over the first/last
pipeline stage, on the local shards (every such rank shards alike).

Zero-bubble schedules (zb-h1, zb-v, dualpipev) split each backward: B computes the input
gradients and queues the linear layers' weight-gradient GEMMs, W runs them later. FSDP2's
post-backward hook runs at the end of B, before W has written those gradients, so the engine
announces every backward as not the last and calls `after_weight(chunk, is_last)` after each
W. W writes each weight's gradient into FSDP2's unsharded parameter (`.grad`), where autograd
would have; after_weight runs FSDP2's post-backward again (fsdp_compat.post_backward_now, as
torch's own pipelining does for FSDP2), which folds it into the accumulator in the reduce dtype
as after a backward, and after the chunk's last W reduce-scatters it: the same accumulation
(bf16 gradients summed in fp32), the same single reduce-scatter per step. Under "microbatch" B
reduce-scatters what it completed (the gradients W does not write: norms, embeddings) and each W
the rest of its microbatch, so two reduce-scatters per unit and microbatch, the same bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

from megatron_lite.parallel import fake
from megatron_lite.parallel.data_parallel import arguments, finalize
from megatron_lite.parallel.data_parallel.ddp import hybrid_groups
from megatron_lite.parallel.data_parallel.finalize import LocalGrad, data_replicas, tied_params
from megatron_lite.parallel.data_parallel.fsdp_comm import count_collectives
from megatron_lite.parallel.data_parallel.fsdp_compat import check_fsdp2, post_backward_now
from megatron_lite.parallel.data_parallel.fsdp_fp8 import wrap_fp8_weights
from megatron_lite.parallel.data_parallel.fsdp_optimizer import FSDPOptimizer
from megatron_lite.parallel.data_parallel.fsdp_whole_matrix import FSDPWholeMatrixOptimizer
from megatron_lite.parallel.data_parallel.memory import sharded_state_bytes, sharded_state_tensors
from megatron_lite.parallel.data_parallel.optimizer_spec import OptimizerSpec
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import meta_of

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch
    FSDPModule = MixedPrecisionPolicy = fully_shard = None

from torch.distributed.device_mesh import DeviceMesh

# parallel.zero3_grad_reduce: where gradients accumulate over microbatches (module docstring)
GRAD_REDUCE = ("step", "microbatch")


def sharding_mesh(mesh: ParallelMesh, name: str, dp_shard: int | None, device_type: str):
    """The DeviceMesh FSDP2 shards over: this rank's `name` group (dp_cp or edp) as a 1-D mesh,
    or, with dp_shard smaller than the group, a 2-D (replicate, shard) mesh (HSDP)."""
    full = getattr(mesh, name)
    with fake.real_tensors():  # the rank table is real even in a dry run
        if dp_shard is None or dp_shard == full.size:
            return DeviceMesh.from_group(full.group, device_type, mesh_dim_names=("shard",))
        shard, replica = hybrid_groups(mesh, name, dp_shard)
        ranks = torch.tensor(full.ranks).reshape(-1, dp_shard)  # row: one shard group
        return DeviceMesh.from_group(
            [replica, shard], device_type, mesh=ranks, mesh_dim_names=("replicate", "shard")
        )


def _expert_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules whose own parameters are all expert parameters (reduced over edp)."""
    out = []
    for m in layer.modules():
        own = list(m.parameters(recurse=False))
        if m is not layer and own and all(meta_of(p).is_expert for p in own):
            out.append(m)
    return out


def _shard_chunk(chunk, layers, dense, experts, kw: dict, storage_on) -> None:
    """fully_shard the expert modules, each layer, then the chunk root; parameters keep their
    metadata; gradients are summed; explicit prefetching between consecutive layers. With
    `storage_on` (a chunk on the meta device) the shards then get storage there."""
    metas = {n: meta_of(p) for n, p in chunk.named_parameters()}
    for p in chunk.parameters():  # the sharded parameters are the fp32 masters
        p.data = p.data.float()
    wrap_fp8_weights(chunk)  # tensorwise FP8 linears: gathered in FP8 (fsdp_fp8.py)
    for layer in layers:
        for m in _expert_modules(layer):
            fully_shard(m, mesh=experts, **kw)
        fully_shard(layer, mesh=dense, **kw)
    # experts outside the layers (an MoE layer of the MTP modules): their own units too, or
    # the root would shard them over dp×cp, mixing different EP ranks' experts
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for m in _expert_modules(chunk):
        if id(m) not in in_layers:
            fully_shard(m, mesh=experts, **kw)
    fully_shard(chunk, mesh=dense, **kw)
    if storage_on is not None:
        _give_shards_storage(chunk, storage_on)
    for n, p in chunk.named_parameters():  # FSDP2 made new (DTensor) parameters
        p.meta = metas[n]
    for m in chunk.modules():
        if isinstance(m, FSDPModule):
            _sum_gradients(m)
            count_collectives(m)  # all_gather_fsdp / reduce_scatter_fsdp in comm_stats
    for a, b in zip(layers, layers[1:], strict=False):
        a.set_modules_to_forward_prefetch([b])  # issued when a's forward starts
        b.set_modules_to_backward_prefetch([a])  # issued when b's backward starts


def _give_shards_storage(chunk: torch.nn.Module, device: torch.device) -> None:
    """Uninitialized storage on `device` for the meta-device shards FSDP2 made: this rank's
    rows of each parameter only (`to_empty`, after which FSDP2 pads its shards again, see
    FSDPModule._apply). Buffers that were not on meta keep their values."""
    kept = [
        (m, n, b)
        for m in chunk.modules()
        for n, b in m.named_buffers(recurse=False)
        if b is not None and not b.is_meta
    ]
    chunk.to_empty(device=device)
    for m, n, b in kept:
        setattr(m, n, b.to(device))


def _storage_device(chunks, device) -> torch.device | None:
    """Where meta-device chunks' shards get storage (None: the chunks have storage already)."""
    on_meta = {p.is_meta for c in chunks for p in c.parameters()}
    if on_meta == {True} and (device is None or torch.device(device).type == "meta"):
        raise ValueError(
            "FullyShardedDataParallel: the chunks are on the meta device but no device= was "
            "given for their shards. Fix: pass device='cuda' (or 'cpu')"
        )
    if len(on_meta) > 1:
        raise ValueError(
            "FullyShardedDataParallel: some parameters are on the meta device and some are not; "
            "to_empty would wipe the others. Fix: build the whole model on meta, or none of it"
        )
    return torch.device(device) if on_meta == {True} else None


def _sum_gradients(m) -> None:
    """Reduce with a plain SUM, no division: the loss is already the global-batch mean (and
    gloo has neither AVG nor PREMUL_SUM). Older torch names the first call differently."""
    divide = getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor
    divide(1.0)
    if hasattr(m, "set_force_sum_reduction_for_comms"):
        m.set_force_sum_reduction_for_comms(True)


def chunk_layers(chunk: torch.nn.Module) -> Iterable[torch.nn.Module]:
    """The default `layers_of`: `chunk.layers.values()`, our models' ModuleDict of layers."""
    layers = getattr(chunk, "layers", None)
    if not isinstance(layers, torch.nn.ModuleDict):
        raise ValueError(
            f"ZeRO-3 shards each transformer layer as one FSDP2 unit, but chunk "
            f"{type(chunk).__name__} has no `layers` ModuleDict to find them in. Fix: pass "
            f"layers_of=lambda chunk: [...] returning the chunk's layers (e.g. chunk.blocks)"
        )
    return layers.values()


class FullyShardedDataParallel:
    """ZeRO stage 3 for one rank's model chunks (see the module docstring); implements
    `DataParallelWrapper` (interface.py). `layers_of(chunk)` lists a chunk's transformer layers,
    each one FSDP2 unit (default `chunk_layers`). Build it with `build_data_parallel`
    (builder.py), which documents the arguments."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        mesh: ParallelMesh,
        *,
        dp_shard: int | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        tie_embeddings: bool = False,
        optimizer: str | OptimizerSpec = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float = 0.0,
        optimizer_args: dict | None = None,
        layers_of: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
        device: torch.device | str | None = None,
        grad_reduce: str = "step",
    ):
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(
                f"FullyShardedDataParallel: grad_reduce={grad_reduce!r} is not one of "
                f"{GRAD_REDUCE}. Fix: pass grad_reduce='step' (one reduce-scatter per step) or "
                f"'microbatch' (one per microbatch, sharded accumulation)"
            )
        self.per_microbatch = grad_reduce == "microbatch"
        if fully_shard is None:
            raise RuntimeError(
                f"parallel.zero_stage=3 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); "
                f"this is torch {torch.__version__}. Fix: upgrade torch or use zero_stage 1 or 2"
            )
        check_fsdp2()  # what we use of FSDP2 is still there, before any mesh or sharding
        args = dict(dp_shard=dp_shard, reshard_after_forward=reshard_after_forward,
                    param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                    tie_embeddings=tie_embeddings, optimizer=optimizer, lr=lr, betas=betas,
                    eps=eps, weight_decay=weight_decay, optimizer_args=optimizer_args,
                    layers_of=layers_of, device=device)  # fmt: skip
        arguments.check_arguments("FullyShardedDataParallel", chunks, mesh, args)
        self.mesh, self.chunks, self.reduce_dtype = mesh, chunks, reduce_dtype
        # each chunk's FSDP2 units, checked before any mesh is built
        units = arguments.check_layers(type(self).__name__, chunks, layers_of or chunk_layers)
        # chunks on the meta device are sharded there first: the whole model never has storage
        storage_on = _storage_device(chunks, device)
        device = storage_on or next(chunks[0].parameters()).device
        dense = sharding_mesh(mesh, "dp_cp", dp_shard, device.type)
        # built on every rank, also where this stage has no expert: hybrid sharding creates
        # process groups, which every rank must create in the same order
        experts = sharding_mesh(mesh, "edp", dp_shard, device.type)
        # identical shards per element: 1, or with HSDP the size of the replicate dim
        self.replicas = {
            is_expert: data_replicas(getattr(mesh, name).size, m.size(m.ndim - 1))
            for is_expert, name, m in ((False, "dp_cp", dense), (True, "edp", experts))
        }
        # the trainer's forward step and the pipeline engine never change a chunk's output in
        # place, which is what this FSDP2 warning (once per rank) is about
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        # inputs are left as they come (fp32 rope tables, the fp32 wire between stages), as
        # in stages 0-2: autocast picks the compute dtype of each op
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        )
        kw = dict(reshard_after_forward=reshard_after_forward, mp_policy=policy)
        for chunk, layers in zip(chunks, units, strict=True):
            _shard_chunk(chunk, layers, dense, experts, kw, storage_on)
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.tied = tied_params(chunks) if mesh.pp.size > 1 and tie_embeddings else []
        spec, hyper = arguments.optimizer_settings(args)
        names = {id(p): n for c in chunks for n, p in c.named_parameters()}
        if spec.elementwise:
            self.optimizer = FSDPOptimizer(self.params, spec, hyper, param_dtype, names)
        else:  # gathered whole to an owner each step
            self.optimizer = FSDPWholeMatrixOptimizer(
                self.params, spec, hyper, param_dtype, names, mesh.tp.group
            )
        self.expected = 1
        self.unsynced: set[int] = set()  # chunks announced "not last" and not yet "last"

    # ------------------------------------------------------------ one step
    def start_step(self, num_microbatches: int) -> None:
        self.expected = num_microbatches
        for p in self.params:
            p.grad = None

    def before_backward(self, chunk: int, is_last: bool) -> None:
        """Before chunk `chunk`'s backward of one microbatch, outside autograd (the pipeline
        engine calls it): FSDP2 reduce-scatters in the step's last backward only, or under
        grad_reduce="microbatch" in every backward, each then FSDP2's last (module docstring)."""
        self.chunks[chunk].set_requires_gradient_sync(is_last or self.per_microbatch)
        self.chunks[chunk].set_is_last_backward(is_last or self.per_microbatch)
        (self.unsynced.discard if is_last else self.unsynced.add)(chunk)

    def after_weight(self, chunk: int, is_last: bool) -> None:
        """After each W of chunk `chunk` under a split schedule (the engine calls it): the new
        weight gradients join FSDP2's accumulated ones; after the step's last W every gradient
        of the chunk is complete, and they are reduce-scattered (under "microbatch": after
        every W, into the sharded gradients)."""
        post_backward_now(self.chunks[chunk], reduce=is_last or self.per_microbatch)
        if is_last:
            self.unsynced.discard(chunk)

    def local_grads(self) -> list[LocalGrad]:
        """This rank's FSDP2 shard of each gradient (parameters that got one this step)."""
        return [
            LocalGrad(p, p.grad.to_local(), self.replicas[p.meta.is_expert])
            for p in self.params
            if p.grad is not None
        ]

    def finish_grad_sync(self) -> None:
        """The sums over TP (sequence-parallel replicas) and over the embedding group (tied
        embeddings), on this rank's shards (FSDP2 reduced them over dp×cp in the backward)."""
        if self.unsynced:
            raise RuntimeError(
                f"ZeRO-3: chunk(s) {sorted(self.unsynced)} had backwards announced with "
                "before_backward(chunk, is_last=False) but none with is_last=True, so their "
                "gradients were accumulated and never reduce-scattered. Fix: announce the "
                "step's last backward of each chunk with is_last=True (the pipeline engine "
                "does), or announce none (every backward then reduces)"
            )
        finalize.sum_model_parallel_copies(self.local_grads(), self.mesh, self.tied)

    def grad_square_sum(self) -> torch.Tensor:
        """This rank's share of the global Σg² (fp64), see `finalize.grad_square_sum`."""
        device = self.params[0].device
        return finalize.grad_square_sum(self.local_grads(), self.mesh.tp.size, device)

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale this rank's gradient shards by max_norm / norm when norm > max_norm > 0."""
        finalize.scale_to_max_norm([g.grad for g in self.local_grads()], norm, max_norm)

    def step(self) -> None:
        """The optimizer on the shards (or on whole parameters, fsdp_whole_matrix.py); FSDP2
        gathers them again in the next forward."""
        self.optimizer.step()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model-state tensors by term (see memory.py; what memory() counts)."""
        return sharded_state_tensors(self.params, self.optimizer.inner, self.optimizer.masters)

    def memory(self, device_type: str | None = None) -> dict[str, int]:
        """This rank's model-state bytes by term (see memory.py), optionally only those on
        devices of `device_type`; grads include the unsharded gradients of the step's peak."""
        # with gradient accumulation FSDP2 keeps the unsharded gradients in the reduce dtype
        # from the first microbatch's backward to the last's reduce-scatter (memory.py)
        # (under "microbatch" only one unit's at a time, transiently: the planner's peak.py)
        keep = self.expected > 1 and not self.per_microbatch
        unsharded = self.reduce_dtype.itemsize if keep else 0
        opt = self.optimizer
        out = sharded_state_bytes(self.params, opt.inner, device_type, unsharded, opt.masters)
        # a whole-matrix optimizer's owner holds its parameters' whole fp32 gradients from
        # their gathers to its step (fsdp_whole_matrix.py): one per whole copy
        mine = [m for m in opt.masters if device_type is None or m.device.type == device_type]
        out["grads"] += 4 * sum(m.numel() for m in mine)
        return out

    def wait_params(self) -> None:
        """Nothing in flight between steps: FSDP2 all-gathers per unit in the forward."""
