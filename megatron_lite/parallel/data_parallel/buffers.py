"""Contiguous parameter and gradient buffers, cut into buckets that are reduced as soon as they
are final, overlapping the rest of the backward (Megatron's ParamAndGradBuffer).

One `GradBuffer` holds the parameters of one model chunk that reduce over the same group (dense:
dp×cp; experts: expert-data-parallel). Each parameter's data is a view into `param_data` and
its `main_grad` (fp32) a view into `grad_data`, laid out in backward order (the last layers
first) and cut into buckets of about `bucket_size` elements. A hook after each gradient
accumulation adds `p.grad` into `main_grad` and frees `p.grad`; when every parameter of a bucket
has received its gradient from the last microbatch of the step, the bucket's reduction is
launched asynchronously: an all-reduce (ZeRO-0), or a reduce-scatter into this rank's shard
(ZeRO-1/2; with hybrid sharding followed by an all-reduce of the shard across replicas).
`finish()` launches what is left (parameters that got no gradient this step) and waits.

Shards: a bucket is padded to a multiple of the shard group's size s; shard r of it is the
r-th 1/s of it. For ZeRO-2 the full-size gradient buffer exists only from the first gradient of
a step to the end of its reduction: between steps only the shard is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lite.parallel import mappings
from megatron_lite.parallel.data_parallel.finalize import data_replicas


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    start: int  # [start, end) of the buffers; end - start is a multiple of the shard size
    end: int
    ready: int = 0  # parameters whose last gradient of the step has arrived
    work: object | None = None  # the in-flight reduction
    gather: object | None = None  # the in-flight parameter all-gather (ZeRO-1/2)
    reduced: bool = False

    def shard_range(self, rank: int, size: int) -> tuple[int, int]:
        n = (self.end - self.start) // size
        return self.start + rank * n, self.start + (rank + 1) * n


@dataclass
class ParamRange:
    """Where one parameter lives in a buffer: [start, start + numel)."""

    param: torch.nn.Parameter
    start: int
    bucket: Bucket = field(repr=False)


class GradBuffer:
    """See the module docstring. `shard_group` is the group a bucket is sharded over (None:
    replicated, ZeRO-0: all-reduce over `group`); `replica_group` all-reduces the shards across
    replicas (hybrid sharding)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group,
        *,
        shard_group=None,
        replica_group=None,
        bucket_size: int,
        own_bucket: set[int] = frozenset(),
        reduce_dtype: torch.dtype = torch.float32,
        keep_full_grads: bool = True,
        overlap: bool = True,
    ):
        self.group, self.shard_group, self.replica_group = group, shard_group, replica_group
        self.shard_size = mappings.size(shard_group) if shard_group is not None else 1
        self.shard_rank = dist.get_rank(shard_group) if self.shard_size > 1 else 0
        # ranks holding an identical copy of a reduced element (the global grad norm's count)
        self.replicas = data_replicas(mappings.size(group), self.shard_size)
        self.reduce_dtype, self.keep_full_grads, self.overlap = (
            reduce_dtype,
            keep_full_grads,
            overlap,
        )
        self.ranges: dict[int, ParamRange] = {}
        self.buckets = self._layout(params, bucket_size, own_bucket)
        total = self.buckets[-1].end if self.buckets else 0
        device, dtype = params[0].device, params[0].dtype
        self.param_data = torch.zeros(total, dtype=dtype, device=device)
        self.grad_data = torch.zeros(total, dtype=torch.float32, device=device)
        for r in self.ranges.values():
            p, n = r.param, r.param.numel()
            self.param_data[r.start : r.start + n].copy_(p.data.reshape(-1))
            p.data = self.param_data[r.start : r.start + n].view_as(p)
            p.main_grad = self.grad_data[r.start : r.start + n].view_as(p)
        self.counts: dict[int, int] = {}
        self.expected = 1
        self.pending_gathers = 0  # all-gathers launched by gather_params, not yet waited for
        self.grad_shard = self._make_grad_shard(total)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _layout(self, params, bucket_size: int, own_bucket) -> list[Bucket]:
        """Buckets in backward order; parameters in `own_bucket` (ids) get one each, so its
        shard layout is the same on every rank that holds a copy (tied embeddings)."""
        buckets, current, start, offset = [], [], 0, 0

        def close() -> None:
            nonlocal current, start, offset
            if current:
                end = start + -(-(offset - start) // self.shard_size) * self.shard_size
                bucket = Bucket(current, start, end)
                for p in current:
                    self.ranges[id(p)].bucket = bucket
                buckets.append(bucket)
                current, start, offset = [], end, end

        for p in reversed(params):
            alone = id(p) in own_bucket
            if alone:
                close()
            self.ranges[id(p)] = ParamRange(p, offset, None)
            current.append(p)
            offset += p.numel()
            if alone or offset - start >= bucket_size:
                close()
        close()
        return buckets

    def _make_grad_shard(self, total: int) -> torch.Tensor:
        """This rank's shard of every bucket, concatenated in bucket order."""
        if self.shard_size == 1:
            return self.grad_data
        if self.keep_full_grads:  # ZeRO-1: the shard is a view per bucket (see shard_grad)
            return self.grad_data
        return torch.zeros(
            total // self.shard_size, dtype=torch.float32, device=self.grad_data.device
        )

    def shard_slices(self):
        """(bucket, [a, b) in the buffers, [c, d) in grad_shard) for this rank's shards."""
        out, pos = [], 0
        for b in self.buckets:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            if self.keep_full_grads or self.shard_size == 1:
                out.append((b, (a, e), (a, e)))
            else:
                out.append((b, (a, e), (pos, pos + e - a)))
                pos += e - a
        return out

    # ------------------------------------------------------------ the step
    def start_step(self, num_microbatches: int) -> None:
        """Called before the first backward of a step: gradients are final after this many."""
        self.expected, self.counts = num_microbatches, {}
        if self.grad_data.untyped_storage().size() == 0:  # ZeRO-2 freed it after the last step
            self.grad_data.untyped_storage().resize_(self.grad_data.numel() * 4)
        self.grad_data.zero_()
        for b in self.buckets:
            b.ready, b.work, b.reduced = 0, None, False

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None:  # None: linear_async added the weight gradient into main_grad
            p.main_grad.add_(p.grad)  # accumulate in fp32, whatever the parameter dtype
            p.grad = None
        if getattr(p, "wgrad_pending", 0):  # its wgrad GEMM is queued: finish() reduces it
            return
        key = id(p)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] == self.expected:
            bucket = self.ranges[key].bucket
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and self.overlap:
                self._launch(bucket)

    def _launch(self, b: Bucket) -> None:
        grad = self.grad_data[b.start : b.end]
        payload = grad if self.reduce_dtype == torch.float32 else grad.to(self.reduce_dtype)
        if self.shard_size == 1:
            b.work = (payload, mappings.all_reduce_async(payload, self.group, "all_reduce_dp"))
        else:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            out = payload[a - b.start : e - b.start]
            kind = "reduce_scatter_dp"
            b.work = (payload, mappings.reduce_scatter_async(out, payload, self.shard_group, kind))

    def _complete(self, b: Bucket):
        """Wait for a bucket's reduction; with hybrid sharding, start the all-reduce of this
        rank's shard across replicas and return its handle (None otherwise)."""
        payload, work = b.work
        work.wait()
        a, e = b.start, b.end  # what the reduction filled: the bucket, or this rank's shard
        if self.shard_size > 1:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
        if payload.dtype != self.grad_data.dtype:  # reduced in bf16: back into fp32
            self.grad_data[a:e].copy_(payload[a - b.start : e - b.start])
        b.reduced, b.work = True, None
        if self.shard_size > 1 and mappings.size(self.replica_group) > 1:  # hybrid: over replicas
            shard = self.grad_data[a:e]
            return mappings.all_reduce_async(shard, self.replica_group, "all_reduce_dp")
        return None

    def finish(self) -> None:
        """After the last backward of the step: every bucket reduced (launch what is left)."""
        for b in self.buckets:
            if b.work is None and not b.reduced:
                self._launch(b)
        across_replicas = [self._complete(b) for b in self.buckets if not b.reduced]
        for work in across_replicas:  # all in flight together, not one bucket at a time
            if work is not None:
                work.wait()
        if not self.keep_full_grads and self.shard_size > 1:  # ZeRO-2: keep only the shard
            for _, (a, e), (c, d) in self.shard_slices():
                self.grad_shard[c:d].copy_(self.grad_data[a:e])
            self.grad_data.untyped_storage().resize_(0)

    # ------------------------------------------------------------ parameters (ZeRO-1/2)
    def gather_params(self, wait: bool) -> None:
        """All-gather every bucket's parameters from the shards (after the optimizer step)."""
        if self.shard_size == 1:
            return
        for b in reversed(self.buckets):  # forward order: the first layers' weights first
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            full = self.param_data[b.start : b.end]
            b.gather = mappings.all_gather_async(full, self.param_data[a:e], self.shard_group)
            self.pending_gathers += 1
        if wait:
            self.wait_params()

    def wait_params(self, params=None) -> None:
        """Wait for the all-gathers of the buckets holding `params` (default: all)."""
        if not self.pending_gathers:  # every forward pre-hook asks: answer at once when done
            return
        buckets = (
            self.buckets
            if params is None
            else {
                id(self.ranges[id(p)].bucket): self.ranges[id(p)].bucket
                for p in params
                if id(p) in self.ranges
            }.values()
        )
        for b in buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None
                self.pending_gathers -= 1
