"""Contiguous parameter and gradient buffers, cut into buckets that are reduced as soon as they
are final, overlapping the rest of the backward (Megatron's ParamAndGradBuffer).

One `GradBuffer` holds the parameters of one model chunk that reduce over the same group (dense:
dp×cp; experts: expert-data-parallel). Each parameter's data is a view into `param_data` and
its `main_grad` (fp32) a view into its bucket's gradient storage, laid out in backward order
(the last layers first) and cut into buckets of about `bucket_size` elements. A pre-hook on each
parameter's gradient accumulator (autograd's AccumulateGrad node) takes the gradient that
reached the parameter in this backward, adds it into `main_grad` and hands autograd nothing to
store (`p.grad` stays None); the bucket's reduction is launched asynchronously once every
parameter of it has its gradient: an all-reduce (ZeRO-0), or a reduce-scatter into this rank's
shard (ZeRO-1/2; with hybrid sharding followed by an all-reduce of the shard across replicas).
`finish()` launches what is left (parameters that got no gradient) and waits.

One thread, in backward order. Bucket launches must come in the same order on every rank (NCCL
pairs collectives by order), so the bookkeeping must never depend on which autograd thread runs
an accumulator. On CUDA the engine runs a node on the thread of its input's device, and an
accumulator whose input is undefined on the CPU thread, beside the device thread running the
rest of the backward. So no writer of `main_grad` hands autograd an undefined gradient: it
returns `p.main_grad_placeholder`, a zero-stride expand of one 0-dim zero on the parameter's
device (the buffer's, 2 or 4 bytes, no storage per parameter) that keeps the accumulator on
the device thread, in backward order; the pre-hook recognises it (nothing to add) and returns
None, so AccumulateGrad never materialises it into a weight-sized `.grad` (it would, since an
expanded tensor breaks the gradient layout contract). Readiness stays autograd's: the
accumulator runs once per backward, after every use of the parameter has contributed (a weight
used twice, tied embeddings), which a callback from the linear could not know (a weight two
fused linears use in one backward gets two placeholders, which autograd's input buffer sums into
a weight-sized tensor of zeros: correct, one temporary weight more). The pre-hook
records the thread of a step's first gradient and refuses, with an error naming rank, step and
parameter, one arriving on another thread before `finish()`. An accumulator that gets no
gradient at all (a custom function returning None) is left alone, on whatever thread: the
parameter is not counted and its bucket is reduced by `finish()`, in bucket order.

Shards: a bucket is padded to a multiple of the shard group's size s; shard r of it is the
r-th 1/s of it.

ZeRO-0/1: one fp32 buffer `grad_data` (4Ψ) holds every bucket for the whole step; gradients
accumulate in it over the microbatches and each bucket is reduced once, when its parameters
have the step's last microbatch's gradients.

ZeRO-2 (`keep_full_grads=False`, s > 1): only the shard `grad_shard` (4Ψ/s fp32) persists.
Each bucket has its own full-size storage, allocated when the bucket's first gradient of a
microbatch is about to be written (`ensure`, which every writer of `main_grad` calls first:
the pre-hook, and linear_async through `p.ensure_main_grad`), reduce-scattered as soon as every
parameter of it has its gradient of the microbatch, the reduced shard added into `grad_shard`,
then freed. So gradients are reduced every microbatch, as DeepSpeed's ZeRO-2 does, and memory
does not grow with the microbatches: M reduce-scatters of 4Ψ bytes per step where ZeRO-1 sends
one (M microbatches; the weight all-gather and the hybrid all-reduce of the shard stay once
per step). A bucket never takes a write while its reduce-scatter is in flight: `ensure` waits
for it and adds it into the shard first (the next microbatch writing into a bucket still in
flight, a deferred wgrad). With overlap, one reduce-scatter per reduction group is in flight at
a time (`in_flight`, a list the buffers of one group share: the dense buffers of all model
chunks, or their expert buffers): launching a bucket completes the one before it, which had the
accumulation of this one to finish. Only the running chunk's backward writes gradients, in the
layout's (backward) order, so the full-size bucket storage alive at once is at most two buckets
per group, the one reduce-scattering and the one accumulating: `in_flight_bound`, 4 bytes per
element (under bf16 reduction the one in flight
is its 2-byte copy, the fp32 storage freed at launch). Without overlap (`overlap=False`) a
bucket is reduce-scattered and waited for as soon as it is ready. A bucket whose parameters
got no gradient in a microbatch keeps accumulating (beyond the bound) and is reduced by
`finish()`. A parameter whose wgrad GEMM is deferred (linear_async: a zero-bubble schedule's
B queued it for W) counts a microbatch's gradient once the GEMMs queued up to that backward
have run (`wgrad_queued` at the hook, `wgrad_done` after each, `after_wgrad`), so its bucket
launches from the W that completes it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from megatron_lite.parallel import mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.data_parallel.finalize import data_replicas


@dataclass(eq=False)  # compared by identity (the in-flight list)
class Bucket:
    params: list[torch.nn.Parameter]
    start: int  # [start, end) of the buffers; end - start is a multiple of the shard size
    end: int
    ready: int = 0  # parameters with `target` gradients counted
    target: int = 1  # ZeRO-0/1: the step's microbatches; ZeRO-2: the round being accumulated
    work: object | None = None  # the in-flight reduction: (payload, handle)
    gather: object | None = None  # the in-flight parameter all-gather (ZeRO-1/2)
    reduced: bool = False  # ZeRO-0/1: reduced this step
    grad: torch.Tensor | None = field(default=None, repr=False)  # [end - start] fp32
    shard_at: int = 0  # ZeRO-2: where this rank's shard of the bucket starts in grad_shard
    dirty: bool = False  # ZeRO-2: written since its last reduce-scatter
    launches: int = 0  # ZeRO-2: reduce-scatters this step

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
    replicas (hybrid sharding); `keep_full_grads=False` is ZeRO-2, whose buckets in flight
    are listed in `in_flight` (shared by the buffers of one reduction group; default: its own).
    `names` (id(p) -> name) names parameters in errors."""

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
        in_flight: list | None = None,
        names: dict[int, str] | None = None,
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
        # ZeRO-2: per-bucket gradient storage, only while a bucket accumulates and reduces
        self.sharded_grads = not keep_full_grads and self.shard_size > 1
        self.ranges: dict[int, ParamRange] = {}
        self.buckets = self._layout(params, bucket_size, own_bucket)
        self.numel = self.buckets[-1].end if self.buckets else 0
        device, dtype = params[0].device, params[0].dtype
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        # the weights move into the flat buffer first (each old storage freed as its
        # parameter switches), then the gradient buffer is allocated: the build holds
        # the weights twice or the weights and the gradients, never all three
        for r in self.ranges.values():
            p, n = r.param, r.param.numel()
            self.param_data[r.start : r.start + n].copy_(p.data.reshape(-1))
            p.data = self.param_data[r.start : r.start + n].view_as(p)
            if self.sharded_grads:  # every writer of main_grad calls it first (linear_async)
                p.ensure_main_grad = functools.partial(self.ensure, p)
        self.grad_data = None  # ZeRO-0/1: the whole fp32 gradient buffer
        if not self.sharded_grads:
            self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # what writers of main_grad hand autograd (module docstring): no storage per parameter
        self._zero = torch.zeros((), dtype=dtype, device=device)
        self._placeholders: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            n = b.end - b.start
            b.grad = (
                self.grad_data[b.start : b.end]
                if self.grad_data is not None
                else torch.empty(n, dtype=torch.float32, device=device)
            )
            for p in b.params:
                r = self.ranges[id(p)]
                at = r.start - b.start
                p.main_grad = b.grad[at : at + p.numel()].view_as(p)
                p.main_grad_placeholder = self._zero.expand(p.shape)
                self._placeholders[id(p)] = p.main_grad_placeholder
                p.after_wgrad = functools.partial(self._after_wgrad, p)  # linear_async calls
            if self.sharded_grads:  # ZeRO-2: storage only while the bucket reduces, so the
                b.grad.untyped_storage().resize_(0)  # build holds one bucket at a time
        self.counts: dict[int, int] = {}
        # per parameter: wgrad_queued at each backward whose gradient waits for its W
        self._awaiting: dict[int, list[int]] = {}
        self.expected = 1
        self.pending_gathers = 0  # all-gathers launched by gather_params, not yet waited for
        self.grad_shard = self._make_grad_shard(self.numel)
        for b, _, (c, _) in self.shard_slices():
            b.shard_at = c
        # ZeRO-2: (buffer, bucket) launched and not yet added into its shard, over the group
        self.in_flight: list[tuple[GradBuffer, Bucket]] = [] if in_flight is None else in_flight
        self.names = names or {}
        self._thread: threading.Thread | None = None  # the thread of this step's gradients
        # autograd holds a leaf's accumulator weakly: keep them, or the pre-hooks go with them
        self._grad_accs = [get_gradient_edge(p).node for p in params]
        self._hooks = [
            acc.register_prehook(functools.partial(self._on_grad, p))
            for acc, p in zip(self._grad_accs, params, strict=True)
        ]

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
        if not self.sharded_grads:  # ZeRO-0/1: the shard is a view per bucket (shard_slices)
            return self.grad_data
        return torch.zeros(
            total // self.shard_size, dtype=torch.float32, device=self.param_data.device
        )

    def shard_slices(self):
        """(bucket, [a, b) in the buffers, [c, d) in grad_shard) for this rank's shards."""
        out, pos = [], 0
        for b in self.buckets:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            if not self.sharded_grads:
                out.append((b, (a, e), (a, e)))
            else:
                out.append((b, (a, e), (pos, pos + e - a)))
                pos += e - a
        return out

    # ------------------------------------------------------------ the step
    def start_step(self, num_microbatches: int) -> None:
        """Called before the first backward of a step: gradients are final after this many."""
        self.expected, self.counts, self._thread = num_microbatches, {}, None
        if self.sharded_grads:
            for b in self.buckets:  # nothing left from a step that did not finish
                if b.work is not None:
                    b.work[1].wait()
                self._free(b)
            self.in_flight[:] = [x for x in self.in_flight if x[0] is not self]
            self.grad_shard.zero_()
        else:
            self.grad_data.zero_()
        for b in self.buckets:
            b.ready, b.work, b.reduced, b.dirty, b.launches = 0, None, False, False, 0
            b.target = 1 if self.sharded_grads else num_microbatches

    def ensure(self, p: torch.nn.Parameter) -> None:
        """ZeRO-2, before anything writes into `p.main_grad`: its bucket has storage (zeros
        when new) and no reduce-scatter of it in flight (waited for, added into the shard)."""
        b = self.ranges[id(p)].bucket
        if b.work is not None:
            self._complete(b)
        if not b.grad.untyped_storage().nbytes():
            self._allocate(b)
        b.dirty = True

    def _on_grad(self, p: torch.nn.Parameter, grads: tuple) -> tuple:
        """Pre-hook of `p`'s AccumulateGrad: `grads[0]` is the sum of what reached `p` in this
        backward and goes into main_grad (the placeholder: it is there already). Returns
        (None,): autograd stores nothing in `p.grad`."""
        grad = grads[0]
        if grad is None or self._placeholders.get(id(p)) is not p.main_grad_placeholder:
            return grads  # no gradient (module docstring), or a newer buffer owns `p`
        self._check_thread(p)
        if grad is not p.main_grad_placeholder:  # (the placeholder: linear_async wrote it)
            if self.sharded_grads:
                self.ensure(p)
            p.main_grad.add_(grad)  # accumulate in fp32, whatever the parameter dtype
        queued = getattr(p, "wgrad_queued", 0)
        if queued > getattr(p, "wgrad_done", 0):  # wgrad GEMMs still queued: counted once run
            self._awaiting.setdefault(id(p), []).append(queued)
        else:
            self._count(p)
        return (None,)

    def _after_wgrad(self, p: torch.nn.Parameter) -> None:
        """One of `p`'s deferred wgrad GEMMs ran (linear_async): count the microbatches whose
        GEMMs have all run."""
        if self._placeholders.get(id(p)) is not p.main_grad_placeholder:
            return  # a newer buffer owns `p`
        awaiting = self._awaiting.get(id(p), [])
        while awaiting and p.wgrad_done >= awaiting[0]:
            awaiting.pop(0)
            self._count(p)

    def _check_thread(self, p: torch.nn.Parameter) -> None:
        """Every gradient of a step on one thread (module docstring), or a clear error."""
        here = threading.current_thread()
        if self._thread is None:
            self._thread = here
        elif here is not self._thread:
            name = self.names.get(id(p), f"#{list(self.ranges).index(id(p))} {tuple(p.shape)}")
            raise RuntimeError(
                f"rank {dist.get_rank()} step {STATS.step}: the gradient hook of parameter "
                f"{name} (buffer over group {mappings.group_name(self.group)}) ran on thread "
                f"{here.name!r}, but this step's gradients so far reached the buffer on thread "
                f"{self._thread.name!r}: bucket reductions would start in a timing-dependent "
                "order and pair up wrong buckets across ranks. Fix: custom autograd functions "
                "that write main_grad return `p.main_grad_placeholder` as the gradient (never "
                "None), and every backward of a step runs from one thread"
            )

    def _count(self, p: torch.nn.Parameter) -> None:
        """One more gradient of `p`: launch its bucket once every parameter has its last."""
        key = id(p)
        self.counts[key] = self.counts.get(key, 0) + 1
        bucket = self.ranges[key].bucket
        if self.counts[key] == bucket.target:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._on_ready(bucket)

    def _on_ready(self, b: Bucket) -> None:
        """Every parameter of `b` has its gradient of the step (ZeRO-0/1) or of the current
        microbatch (ZeRO-2, whose next round counts the parameters already past it)."""
        if not self.sharded_grads:
            if self.overlap:
                self._launch(b)
            return
        b.target += 1
        b.ready = sum(self.counts.get(id(q), 0) >= b.target for q in b.params)
        self._launch(b)
        if not self.overlap:
            self._complete(b)
            return
        for buf, other in [x for x in self.in_flight if x[1] is not b]:  # one at a time
            buf._complete(other)

    def _launch(self, b: Bucket) -> None:
        if self.sharded_grads:
            if b.work is not None:  # (a write completes it first) never two at once
                self._complete(b)
            if not b.grad.untyped_storage().nbytes():  # no gradient since: zeros
                self._allocate(b)
            b.dirty, b.launches = False, b.launches + 1
        grad = b.grad
        payload = grad if self.reduce_dtype == torch.float32 else grad.to(self.reduce_dtype)
        if self.shard_size == 1:
            b.work = (payload, mappings.all_reduce_async(payload, self.group, "all_reduce_dp"))
        else:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            out = payload[a - b.start : e - b.start]
            kind = "reduce_scatter_dp"
            b.work = (payload, mappings.reduce_scatter_async(out, payload, self.shard_group, kind))
        if self.sharded_grads:
            self.in_flight.append((self, b))
            if payload is not grad:  # the low-precision copy carries the sums: free the fp32
                self._free(b)

    def _complete(self, b: Bucket):
        """Wait for a bucket's reduction; with hybrid sharding, start the all-reduce of this
        rank's shard across replicas and return its handle (None otherwise). ZeRO-2: add the
        reduced shard into `grad_shard` and free the bucket (the replicas sum in finish())."""
        payload, work = b.work
        work.wait()
        b.work = None
        if self.sharded_grads:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
            reduced = payload[a - b.start : e - b.start]
            self.grad_shard[b.shard_at : b.shard_at + e - a].add_(reduced)
            self._free(b)
            self.in_flight[:] = [x for x in self.in_flight if x[1] is not b]
            return None
        a, e = b.start, b.end  # what the reduction filled: the bucket, or this rank's shard
        if self.shard_size > 1:
            a, e = b.shard_range(self.shard_rank, self.shard_size)
        if payload.dtype != self.grad_data.dtype:  # reduced in bf16: back into fp32
            self.grad_data[a:e].copy_(payload[a - b.start : e - b.start])
        b.reduced = True
        if self.shard_size > 1 and mappings.size(self.replica_group) > 1:  # hybrid: over replicas
            shard = self.grad_data[a:e]
            return mappings.all_reduce_async(shard, self.replica_group, "all_reduce_dp")
        return None

    def finish(self) -> None:
        """After the last backward of the step: every bucket reduced (launch what is left)."""
        self._thread = None  # the step's backward is over
        if self.sharded_grads:
            self._finish_sharded()
            return
        for b in self.buckets:
            if b.work is None and not b.reduced:
                self._launch(b)
        across_replicas = [self._complete(b) for b in self.buckets if not b.reduced]
        for work in across_replicas:  # all in flight together, not one bucket at a time
            if work is not None:
                work.wait()

    def _finish_sharded(self) -> None:
        """ZeRO-2: reduce-scatter the buckets written since their last reduction (and those no
        gradient reached this step, as zeros: every rank sends the same collectives), add them
        into the shard, then sum the shard across replicas (hybrid sharding), once."""
        for b in self.buckets:
            if b.work is None and (b.dirty or not b.launches):
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                self._complete(b)
        if mappings.size(self.replica_group) > 1:
            works = [
                mappings.all_reduce_async(self.grad_shard[c:d], self.replica_group, "all_reduce_dp")
                for _, _, (c, d) in self.shard_slices()
            ]
            for work in works:  # all in flight together
                work.wait()

    def _allocate(self, b: Bucket) -> None:
        b.grad.untyped_storage().resize_(4 * (b.end - b.start))
        b.grad.zero_()

    @staticmethod
    def _free(b: Bucket) -> None:
        b.grad.untyped_storage().resize_(0)  # the parameters' main_grad views stay valid

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


def in_flight_bound(buffers: list[GradBuffer]) -> int:
    """ZeRO-2: the most bytes of full-size bucket storage alive at once over `buffers` (see
    the module docstring): per reduction group (buffers sharing `in_flight`), its two largest
    buckets, one reduce-scattering and one accumulating (one bucket: itself). 0 for ZeRO-0/1,
    whose `grad_data` holds every bucket."""
    groups: dict[int, list[int]] = {}
    for buf in buffers:
        if buf.sharded_grads:
            sizes = groups.setdefault(id(buf.in_flight), [])
            sizes += [4 * (b.end - b.start) for b in buf.buckets]
    return sum(sum(sorted(sizes)[-2:]) for sizes in groups.values())
