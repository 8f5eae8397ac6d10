"""`DataParallel`: gradient buffers, overlapped bucketed reduction and the (distributed)
optimizer (an `OptimizerSpec`, AdamW by default) for one rank's model chunks, for ZeRO stages 0,
1 and 2 and hybrid sharding.

| stage | masters, opt. states  | gradients               | per bucket                          |
|-------|-----------------------|-------------------------|-------------------------------------|
| 0     | replicated            | full                    | all-reduce once per step            |
| 1     | 1/N per rank          | full                    | reduce-scatter once per step; gather |
| 2     | 1/N                   | 1/N + buckets in flight | reduce-scatter each microbatch; gather |

N is the sharding degree: the gradient's reduction group (dp×cp for dense parameters,
expert-data-parallel for experts), or `dp_shard` ranks of it with hybrid sharding (shards are
then all-reduced across the replicas). Gradients that need another sum first (sequence-parallel
replicas over TP, tied embeddings over the first/last stage) are summed after the data-parallel
reduction on this rank's shard: every TP rank (every holder of the tied weight) lays its buffer
out alike, so their shards cover the same elements. ZeRO-2's memory and communication with
gradient accumulation: buffers.py. Parameters whose optimizer group needs whole matrices
(Muon's) sit in buffers of their own and are assigned whole to owner ranks instead of flat
shards: whole_matrix.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel import fake
from megatron_lite.parallel.data_parallel import arguments, finalize, rules, whole_matrix
from megatron_lite.parallel.data_parallel.buffers import GradBuffer
from megatron_lite.parallel.data_parallel.finalize import LocalGrad, tied_params
from megatron_lite.parallel.data_parallel.memory import buffer_state_bytes, buffer_state_tensors
from megatron_lite.parallel.data_parallel.nvme import NvmeSettings, swapped_bytes
from megatron_lite.parallel.data_parallel.optimizer import ShardedOptimizer, make_pieces
from megatron_lite.parallel.data_parallel.optimizer_spec import OptimizerSpec, needs_whole
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import meta_of


def hybrid_groups(mesh: ParallelMesh, name: str, dp_shard: int):
    """(shard group, replica group) of this rank inside its `name` group (dp_cp or edp): shards
    are consecutive blocks of dp_shard ranks of it, replicas the ranks at the same position in
    each block. Every rank creates every group, in the same order."""
    mine = (None, None)
    for ranks in mesh.layout.groups(name):
        blocks = [ranks[i : i + dp_shard] for i in range(0, len(ranks), dp_shard)]
        shard = [(b, dist.new_group(b, group_desc=f"{name}_shard")) for b in blocks]
        across = [[b[j] for b in blocks] for j in range(dp_shard)]
        replica = [(a, dist.new_group(a, group_desc=f"{name}_replica")) for a in across]
        for b, g in shard:
            if mesh.rank in b:
                mine = (g, mine[1])
        for a, g in replica:
            if mesh.rank in a:
                mine = (mine[0], g)
    return mine


class DataParallel:
    """ZeRO stage 0, 1 or 2 for one rank's model chunks (see the module docstring); implements
    `DataParallelWrapper` (interface.py). Build it with `build_data_parallel` (builder.py),
    which documents the arguments."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        mesh: ParallelMesh,
        *,
        zero_stage: int = 0,
        dp_shard: int | None = None,
        bucket_size: int = 40_000_000,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        grad_reduce_dtype: torch.dtype = torch.float32,
        tie_embeddings: bool = False,
        optimizer: str | OptimizerSpec = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float = 0.0,
        optimizer_args: dict | None = None,
        offload: bool | str = False,
        nvme_path: str | None = None,
        nvme_buffer_mb: int = 1024,
    ):
        args = dict(zero_stage=zero_stage, dp_shard=dp_shard, bucket_size=bucket_size,
                    overlap_grad_reduce=overlap_grad_reduce,
                    overlap_param_gather=overlap_param_gather, grad_reduce_dtype=grad_reduce_dtype,
                    tie_embeddings=tie_embeddings, optimizer=optimizer, lr=lr, betas=betas,
                    eps=eps, weight_decay=weight_decay, optimizer_args=optimizer_args,
                    offload=offload, nvme_path=nvme_path,
                    nvme_buffer_mb=nvme_buffer_mb)  # fmt: skip
        if zero_stage == 3 and rules.is_int(zero_stage):
            raise arguments.DataParallelArgumentError(
                "DataParallel", "zero_stage", zero_stage, "DataParallel runs stages 0-2",
                "use FullyShardedDataParallel, or build_data_parallel(..., zero_stage=3)",
            )  # fmt: skip
        arguments.check_arguments("DataParallel", chunks, mesh, args)
        spec, hyper = arguments.optimizer_settings(args)
        self.mesh, self.zero_stage, self.overlap_param_gather = (
            mesh,
            zero_stage,
            overlap_param_gather,
        )
        named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
        # parameters whose update needs the whole matrix (whole_matrix.py); the others flat
        whole = {} if spec.elementwise else needs_whole(spec, hyper, named)
        self.groups = {}
        for name in ("dp_cp", "edp"):
            full = getattr(mesh, name)
            n = dp_shard or full.size
            if zero_stage == 0:
                self.groups[name] = (full.group, None, None)
            elif n == full.size:
                self.groups[name] = (full.group, full.group, None)
            else:
                self.groups[name] = (full.group, *hybrid_groups(mesh, name, n))
        self.tied = [] if mesh.pp.size == 1 or not tie_embeddings else tied_params(chunks)
        self.buffers, kinds, wholes = self._build_buffers(
            chunks, bucket_size, grad_reduce_dtype, zero_stage < 2, overlap_grad_reduce, whole
        )
        self.whole_buffers = [b for b, w in zip(self.buffers, wholes, strict=True) if w]
        flat = [b for b, w in zip(self.buffers, wholes, strict=True) if not w]
        self.owners = None  # whole_matrix.py: {id(param): owner} under ZeRO-1/2
        if self.whole_buffers and zero_stage:
            cost = (lambda p: spec.cost(p, hyper)) if spec.cost else (lambda p: p.numel())
            whole_kinds = [k for k, w in zip(kinds, wholes, strict=True) if w]
            self.owners = whole_matrix.assign_owners(self.whole_buffers, whole_kinds, cost)
        kind = rules.offload_kind(offload)
        if kind == "nvme" and fake.active():  # off the device as under cpu; a dry run writes
            kind = "cpu"  # no swap file (its host buffer and NVMe bytes: plan/offload_bytes.py)
        self.pieces = make_pieces(flat, kind)
        self.pieces += whole_matrix.whole_pieces(self.whole_buffers, self.owners)
        nvme = None
        if kind == "nvme":  # the buffer holds the largest piece's state on any rank (no file yet)
            buffer_bytes = nvme_buffer_mb << 20
            sizes = swapped_bytes(self.pieces, spec, hyper)
            device = self.buffers[0].param_data.device if self.buffers else torch.device("cpu")
            largest = torch.tensor([max(sizes, default=0)], dtype=torch.int64, device=device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # every rank decides alike: no hang
            arguments.check_nvme_buffer(
                "DataParallel", nvme_buffer_mb, [int(largest)], buffer_bytes
            )
            nvme = NvmeSettings(nvme_path, buffer_bytes, dist.get_rank())
        self.optimizer = ShardedOptimizer(self.pieces, spec, hyper, kind, mesh.tp.group, nvme)
        # the next forward waits for the weights only when their all-gather overlaps it
        waits = zero_stage and overlap_param_gather
        self._gather_hooks = [self._register_gather_waits(c) for c in chunks] if waits else []

    def _build_buffers(self, chunks, bucket_size, reduce_dtype, keep_full, overlap, whole):
        """The gradient buffers, one per chunk, reduction group and kind of update (flat
        shards; whole parameters, `whole` {id(param): True}: all-reduced whole, whole_matrix.py),
        each one's group name (dp_cp or edp) and whether it holds whole parameters."""
        buffers, kinds, wholes = [], [], []
        in_flight = {"dp_cp": [], "edp": []}  # ZeRO-2: one reduce-scatter per group at a time
        for chunk in chunks:
            params = [p for p in chunk.parameters() if p.requires_grad]
            names = {id(p): n for n, p in chunk.named_parameters()}
            for name, expert in (("dp_cp", False), ("edp", True)):
                for is_whole in (False, True):
                    mine = [
                        p for p in params
                        if meta_of(p).is_expert == expert and whole.get(id(p), False) == is_whole
                    ]  # fmt: skip
                    if not mine:
                        continue
                    group, shard, replica = self.groups[name]
                    if is_whole:  # every rank reduces the whole gradient (ZeRO-0's buffers)
                        shard, replica = None, None
                    buf = GradBuffer(
                        mine,
                        group,
                        shard_group=shard,
                        replica_group=replica,
                        bucket_size=bucket_size,
                        own_bucket={id(p) for p in self.tied},
                        reduce_dtype=reduce_dtype,
                        keep_full_grads=keep_full or is_whole,
                        overlap=overlap,
                        in_flight=[] if is_whole else in_flight[name],
                        names=names,
                    )
                    buffers.append(buf)
                    kinds.append(name)
                    wholes.append(is_whole)
        return buffers, kinds, wholes

    def _register_gather_waits(self, chunk: torch.nn.Module):
        """Before a module's forward, wait for the all-gather of the buckets holding its
        parameters: the gathers of the last optimizer step overlap this step's forward."""
        if any(getattr(m, "compiled_region", False) for m in chunk.modules()):
            # model.compile: a compiled layer cannot wait inside itself, so the chunk waits for
            # all of its gathers before its forward (no overlap with the forward)
            own = list(chunk.parameters())
            return [chunk.register_forward_pre_hook(lambda m, i: self._wait(own))]
        handles = []
        for module in chunk.modules():
            own = list(module.parameters(recurse=False))
            if own:
                handles.append(
                    module.register_forward_pre_hook(lambda m, i, own=own: self._wait(own))
                )
        return handles

    def _wait(self, params) -> None:
        for buf in self.buffers:
            buf.wait_params(params)

    # ------------------------------------------------------------ one step
    def start_step(self, num_microbatches: int) -> None:
        for buf in self.buffers:
            buf.start_step(num_microbatches)

    def before_backward(self, chunk: int, is_last: bool) -> None:
        """Nothing: the buckets count their gradients and launch when complete."""

    def after_weight(self, chunk: int, is_last: bool) -> None:
        """Nothing: a deferred weight gradient reports itself to its bucket (`after_wgrad`)."""

    def local_grads(self) -> list[LocalGrad]:
        """This rank's reduced gradient shard, one entry per piece (parameter ∩ shard; whole
        parameters this rank owns, whole_matrix.py)."""
        return [LocalGrad(pc.param, pc.grad, 1 if pc.owned else pc.buffer.replicas)
                for pc in self.pieces]  # fmt: skip

    def finish_grad_sync(self) -> None:
        """Every bucket reduced, then the sums over TP (sequence-parallel replicas) and over the
        embedding group (tied embeddings) on this rank's shard (see finalize.py)."""
        for buf in self.buffers:
            buf.finish()
        grads = [g for g, pc in zip(self.local_grads(), self.pieces, strict=True) if not pc.owned]
        if self.owners is not None:  # every whole gradient, whoever owns it
            grads += whole_matrix.whole_grads(self.whole_buffers)
        finalize.sum_model_parallel_copies(grads, self.mesh, self.tied)

    def grad_square_sum(self) -> torch.Tensor:
        """This rank's share of the global Σg² (fp64), see `finalize.grad_square_sum`."""
        device = self.buffers[0].param_data.device if self.buffers else torch.device("cpu")
        return finalize.grad_square_sum(self.local_grads(), self.mesh.tp.size, device)

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale this rank's gradient shard by max_norm / norm when norm > max_norm > 0."""
        finalize.scale_to_max_norm([pc.grad for pc in self.pieces], norm, max_norm)

    def step(self) -> None:
        """The optimizer on the shards, then the updated weights all-gathered (waited for
        before each module's next forward when overlap_param_gather, else here)."""
        self.optimizer.step()
        if self.owners is not None:  # whole parameters from their owners
            whole_matrix.broadcast_params(self.whole_buffers, self.owners)
        for buf in self.buffers:
            buf.gather_params(wait=not self.overlap_param_gather)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model-state tensors by term (see memory.py; what memory() counts)."""
        swap = self.optimizer.swap
        return buffer_state_tensors(self.buffers, self.pieces, self.optimizer.inner, swap)

    def memory(self, device_type: str | None = None) -> dict[str, int]:
        """This rank's model-state bytes by term (see memory.py), optionally only those on
        devices of `device_type` (NVMe offload: the host buffer counts as "optimizer"; the
        swap file's bytes are `nvme_bytes`)."""
        swap = self.optimizer.swap
        return buffer_state_bytes(
            self.buffers, self.pieces, self.optimizer.inner, device_type, swap
        )

    def nvme_bytes(self) -> int:
        """Bytes of this rank's swap file (NVMe offload; else 0)."""
        swap = self.optimizer.swap
        return 0 if swap is None else swap.nbytes

    def close(self) -> None:
        """Remove this rank's swap file (NVMe offload; nothing otherwise)."""
        self.optimizer.close()

    def wait_params(self) -> None:
        for buf in self.buffers:
            buf.wait_params()
