"""Autograd collectives in conjugate pairs. Every function takes the group it communicates over.

| forward                                  | backward                         |
|------------------------------------------|----------------------------------|
| copy_to_tensor_parallel_region           | all-reduce                       |
| reduce_from_tensor_parallel_region       | identity                         |
| scatter_to_tensor_parallel_region (-1)   | all-gather along the last dim    |
| gather_from_tensor_parallel_region (-1)  | split along the last dim         |
| scatter_to_sequence_parallel_region (0)  | all-gather along dim 0           |
| gather_from_sequence_parallel_region (0) | reduce-scatter along dim 0       |
| reduce_scatter_to_sequence_parallel (0)  | all-gather along dim 0           |
| all_to_all (split dim a, concat dim b)   | all_to_all (split b, concat a)   |
| all_to_all_uneven (splits in, out)       | all_to_all_uneven (out, in)      |

Each collective reports its payload to `comm_stats.STATS` and turns a backend failure (timeout,
dead peer) into a `CollectiveError` naming rank, step, op and group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_lite.parallel import compiled_comm
from megatron_lite.parallel.comm_stats import STATS

# torch 2.13 renamed the *_tensor collectives to *_single; older releases (2.6-2.12) only
# have the old names.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names rank, step, op and group."""


def group_name(group: dist.ProcessGroup | None) -> str:
    desc = getattr(group, "group_desc", None) if group is not None else "world"
    return f"{desc} ranks={dist.get_process_group_ranks(group) if group is not None else 'all'}"


def guarded(kind: str, group, fn):
    """Run the collective `fn()` issued outside this module (checkpoint control, DCP, traces):
    it is the rank's last op in a hang dump, and a failure or timeout becomes a CollectiveError
    naming rank, step, op and group."""
    STATS.note(kind, getattr(group, "group_desc", "world"))
    return _guard(kind, group, fn)


def recorded(kind: str, group, fn, shape: tuple):
    """Run `fn()`, a collective of `shape` already recorded in comm_stats (by a caller such as
    FSDP2's collectives, fsdp_comm.py): a failure or timeout becomes a CollectiveError naming
    rank, step, op and group, as for the collectives of this module."""
    return _guard(kind, group, fn, f" of shape {shape}")


def _guard(kind: str, group, fn, detail: str = ""):
    try:
        if STATS.wait_timer is not None:  # the straggler detector's (CUDA)
            with STATS.wait_timer():
                return fn()
        return fn()
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo/NCCL raise RuntimeError (or subclasses) on timeout/peer loss
        raise CollectiveError(
            f"rank {dist.get_rank()} step {STATS.step}: {kind}{detail} "
            f"on group {group_name(group)} failed: {e}"
        ) from e


def _run(kind: str, op: str, payload: torch.Tensor, group, fn):
    """Record the collective `op` (comm_stats.bus_bytes' names) of `kind`, then run `fn()`."""
    STATS.record(kind, payload, getattr(group, "group_desc", "world"), op=op, n=size(group))
    return _guard(kind, group, fn, f" of shape {tuple(payload.shape)}")


def host_backend() -> str:
    """The backend of the groups whose collectives run on host tensors (checkpointing): gloo,
    or the fake backend when the whole run is a dry run (plan --dry-run)."""
    return "fake" if dist.get_backend() == "fake" else "gloo"


def broadcast_objects(box: list, src: int, group) -> None:
    """dist.broadcast_object_list: `box` as rank `src` has it, on every rank of `group`. A dry
    run's fake group moves nothing: each rank keeps its own `box`."""
    if dist.get_backend(group) != "fake":
        dist.broadcast_object_list(box, src=src, group=group)


def all_gather_objects(out: list, obj, group) -> None:
    """dist.all_gather_object into `out`; under a dry run's fake group every entry is `obj`."""
    if dist.get_backend(group) == "fake":
        out[:] = [obj] * len(out)
    else:
        dist.all_gather_object(out, obj, group=group)


def size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


class RingShift:
    """A tensor in flight to the next rank of a ring while the previous rank's arrives:
    `wait()` returns the received one (a failure or timeout: CollectiveError)."""

    def __init__(self, recv: torch.Tensor, works, group, kind: str):
        self.recv, self.works, self.group, self.kind = recv, works, group, kind

    def wait(self) -> torch.Tensor:
        works, self.works = self.works, []
        for work in works:
            _guard(self.kind, self.group, work.wait, f" of shape {tuple(self.recv.shape)}")
        return self.recv


def ring_shift(t: torch.Tensor, group, kind: str = "cp") -> RingShift:
    """Send `t` to the next rank of `group` and receive the previous rank's tensor of the same
    shape and dtype, asynchronously (one batch_isend_irecv); comm_stats counts the payload as
    `<kind>_send` and `<kind>_recv`. Every rank of the group must call it in the same order."""
    t = t.contiguous()
    recv = torch.empty_like(t)
    n, i = size(group), group_rank(group)
    desc = getattr(group, "group_desc", "world")
    STATS.record(f"{kind}_send", t, desc, op="send", n=2)
    STATS.record(f"{kind}_recv", recv, desc, op="send", n=2)
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, (i + 1) % n), group=group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (i - 1) % n), group=group),
    ]
    works = _guard(kind, group, lambda: dist.batch_isend_irecv(ops), f" of shape {tuple(t.shape)}")
    return RingShift(recv, works, group, f"{kind} ring send/recv")


class AsyncWork:
    """An in-flight collective: `wait()` blocks until it is done and turns a backend failure or
    timeout into a CollectiveError naming rank, step, op and group (like the blocking ones)."""

    def __init__(self, kind: str, group, work, shape):
        self.kind, self.group, self.work, self.shape = kind, group, work, shape

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            _guard(self.kind, self.group, work.wait, f" of shape {self.shape}")


def _start(kind: str, op: str, payload: torch.Tensor, group, launch) -> AsyncWork:
    """Record and start a collective (`launch()` with async_op=True); nothing on a group of one."""
    work = _run(kind, op, payload, group, launch) if size(group) > 1 else None
    return AsyncWork(kind, group, work, tuple(payload.shape))


def all_reduce_async(t: torch.Tensor, group, kind: str = "all_reduce") -> AsyncWork:
    """In-place all-reduce (sum) started now, finished by `.wait()`; reports to comm stats."""
    launch = functools.partial(dist.all_reduce, t, group=group, async_op=True)
    return _start(kind, "all_reduce", t, group, launch)


def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, group, kind: str = "reduce_scatter"):
    """out <- this rank's 1/size chunk of the sum over ranks of t (out may be that chunk of t)."""
    launch = functools.partial(_reduce_scatter_into, out, t, group=group, async_op=True)
    return _start(kind, "reduce_scatter", t, group, launch)


def all_gather_async(out: torch.Tensor, t: torch.Tensor, group, kind: str = "all_gather_dp"):
    """out <- every rank's t in rank order (t may be this rank's chunk of out)."""
    launch = functools.partial(_all_gather_into, out, t, group=group, async_op=True)
    return _start(kind, "all_gather", t, group, launch)


def broadcast_async(t: torch.Tensor, src: int, group, kind: str = "broadcast") -> AsyncWork:
    """t <- rank `src`'s t (a global rank) over `group`, started now; reports to comm stats."""
    launch = functools.partial(dist.broadcast, t, src, group=group, async_op=True)
    return _start(kind, "broadcast", t, group, launch)


def broadcast(t: torch.Tensor, src: int, group, kind: str = "broadcast") -> None:
    """t <- rank `src`'s t (a global rank) over `group`; a no-op on a group of one."""
    broadcast_async(t, src, group, kind).wait()


def gathered(kind: str, group, shard: torch.Tensor, fn):
    """Run `fn()`, an all-gather of this rank's `shard` over `group` issued elsewhere
    (DTensor.full_tensor): recorded in comm stats as one, and guarded like the others."""
    if size(group) == 1:
        return fn()
    return _run(kind, "all_gather", shard, group, fn)


# ---------------------------------------------------------------- raw (non-autograd) collectives
def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
    """In-place all-reduce that reports to comm stats; a no-op on a group of one. Inside a
    compiled region: out of place (use the result), sum or max (compiled_comm.py)."""
    if size(group) > 1 and compiled_comm.compiling():
        return compiled_comm.all_reduce(t, group, "max" if op == dist.ReduceOp.MAX else "sum")
    if size(group) > 1:
        _run(kind, "all_reduce", t, group, lambda: dist.all_reduce(t, op=op, group=group))
    return t


FLAT_BYTES = 32 << 20  # the most bytes all_reduce_flat copies into one coalesced collective


def all_reduce_flat(tensors: list[torch.Tensor], group, chunk_bytes: int = FLAT_BYTES) -> None:
    """Sum many tensors over `group`, in place: a contiguous tensor of at least `chunk_bytes`
    by itself, the others flattened into coalesced all-reduces of at most `chunk_bytes` each
    (one dtype per collective) and copied back, so the copies alive at once stay under
    `chunk_bytes` whatever the tensors' total (a stage's gradients at full size)."""
    if not tensors or size(group) == 1:
        return
    batch: list[torch.Tensor] = []

    def flush() -> None:
        if not batch:
            return
        flat = torch.cat([t.reshape(-1) for t in batch])
        all_reduce(flat, group)
        offset = 0
        for t in batch:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        batch.clear()

    held = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes >= chunk_bytes and t.is_contiguous():
            all_reduce(t, group)
            continue
        if batch and (held + nbytes > chunk_bytes or t.dtype != batch[0].dtype):
            flush()
            held = 0
        batch.append(t)
        held += nbytes
    flush()


def all_gather_dim0(t: torch.Tensor, group, kind: str = "all_gather") -> torch.Tensor:
    """[n, ...] -> [n·size, ...] in rank order."""
    world = size(group)
    if world == 1:
        return t
    if compiled_comm.compiling():
        return compiled_comm.all_gather_dim0(t, group)
    t = t.contiguous()
    out = torch.empty((t.shape[0] * world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _run(kind, "all_gather", t, group, lambda: _all_gather_into(out, t, group=group))
    return out


def reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """[n·size, ...] -> [n, ...]: the sum over ranks of this rank's chunk."""
    world = size(group)
    if world == 1:
        return t
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim 0 ({t.shape[0]}) not divisible by {world}")
    if compiled_comm.compiling():
        return compiled_comm.reduce_scatter_dim0(t, group)
    t = t.contiguous()
    out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _run(
        "reduce_scatter",
        "reduce_scatter",
        t,
        group,
        lambda: _reduce_scatter_into(out, t, group=group),
    )
    return out


def _split(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = size(group)
    if world == 1:
        return t
    if t.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {t.shape[dim]} into {world} parts")
    return t.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    world = size(group)
    if world == 1:
        return t
    g = all_gather_dim0(t.movedim(-1, 0), group)  # [size·h_local, ...]
    g = g.reshape(world, t.shape[-1], *t.shape[:-1])  # [size, h_local, ...]
    return g.permute(*range(2, g.dim()), 0, 1).flatten(-2).contiguous()  # [..., size·h_local]


def _all_to_all(t: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    world = size(group)
    if world == 1:
        return t
    if t.shape[split_dim] % world:
        raise ValueError(
            f"all_to_all: dim {split_dim} of size {t.shape[split_dim]} not divisible "
            f"by group size {world}"
        )
    inp = t.movedim(split_dim, 0).contiguous()  # chunk i of dim 0 goes to rank i
    if compiled_comm.compiling():
        out = compiled_comm.all_to_all_single(inp, group)
    else:
        out = torch.empty_like(inp)
        _run(
            "all_to_all",
            "all_to_all",
            inp,
            group,
            lambda: dist.all_to_all_single(out, inp, group=group),
        )
    # out: [world·chunk, ...] where block i came from rank i; concat the blocks along concat_dim
    out = out.movedim(0, split_dim)
    parts = out.chunk(world, dim=split_dim)
    return torch.cat(parts, dim=concat_dim).contiguous()


def _all_to_all_uneven(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    t = t.contiguous()
    _run(
        "all_to_all",
        "all_to_all",
        t,
        group,
        lambda: dist.all_to_all_single(
            out, t, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
        ),
    )
    return out


# ---------------------------------------------------------------- autograd functions
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_reduce_scatter):
        ctx.group, ctx.rs = group, grad_reduce_scatter
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.rs:
            return reduce_scatter_dim0(g, ctx.group), None, None
        return _split(g, 0, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, concat_dim, group):
        ctx.dims, ctx.group = (split_dim, concat_dim), group
        return _all_to_all(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, g):
        split_dim, concat_dim = ctx.dims
        return _all_to_all(g, concat_dim, split_dim, ctx.group), None, None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all_uneven(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all_uneven(g, in_splits, out_splits, ctx.group), None, None, None


class _AllToAllUnevenStart(torch.autograd.Function):
    """Starts all_to_all_single into a new tensor and returns it unfilled; `_AllToAllWait`
    finishes it. Whatever runs between the two overlaps the exchange. Backward: the reverse
    exchange, blocking (the gradient arrives after _AllToAllWait's backward, an identity)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, box):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        t = x.contiguous()
        launch = functools.partial(
            dist.all_to_all_single,
            out,
            t,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            async_op=True,
        )
        box.append((_start("all_to_all", "all_to_all", t, group, launch), t))
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all_uneven(g, in_splits, out_splits, ctx.group), None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, box):
        work, _ = box.pop()  # the input stays referenced until the exchange is done
        work.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_to_all_uneven_overlap(x, out_splits: list[int], in_splits: list[int], group, during):
    """all_to_all_uneven(x, ...) with `during()` run while the exchange is in flight (e.g. the
    MoE shared expert beside the dispatch). Returns (exchanged x, during's result). The forward
    overlaps; the backward's reverse exchange is blocking."""
    if size(group) == 1:
        return x, during()
    box: list = []
    out = _AllToAllUnevenStart.apply(x, list(out_splits), list(in_splits), group, box)
    result = during()
    return _AllToAllWait.apply(out, box), result


# ---------------------------------------------------------------- public wrappers
def copy_to_tensor_parallel_region(x, group):
    """Identity forward; all-reduce of the gradient over `group`."""
    return _CopyToRegion.apply(x, group) if size(group) > 1 else x


def reduce_from_tensor_parallel_region(x, group):
    """All-reduce forward; identity backward."""
    return _ReduceFromRegion.apply(x, group) if size(group) > 1 else x


def scatter_to_tensor_parallel_region(x, group):
    """Keep this rank's chunk of the last dim; backward all-gathers it."""
    return _ScatterLast.apply(x, group) if size(group) > 1 else x


def gather_from_tensor_parallel_region(x, group):
    """All-gather along the last dim; backward keeps this rank's chunk."""
    return _GatherLast.apply(x, group) if size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    """[s, ...] -> [s/size, ...] (this rank's chunk); backward all-gathers along dim 0."""
    return _ScatterSeq.apply(x, group) if size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, grad_reduce_scatter: bool = True):
    """[s/size, ...] -> [s, ...]. Backward reduce-scatters (the gathered tensor feeds
    tensor-parallel compute whose grads are partial sums) or, if not, just splits."""
    return _GatherSeq.apply(x, group, grad_reduce_scatter) if size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x, group):
    """[s, ...] partial sums -> [s/size, ...] reduced; backward all-gathers along dim 0."""
    return _ReduceScatterSeq.apply(x, group) if size(group) > 1 else x


def all_to_all(x, split_dim: int, concat_dim: int, group):
    """Split `split_dim` across ranks and concatenate what arrives along `concat_dim`."""
    return _AllToAll.apply(x, split_dim, concat_dim, group) if size(group) > 1 else x


def all_to_all_uneven(x, out_splits: list[int], in_splits: list[int], group):
    """all_to_all_single along dim 0 with per-rank split sizes; backward swaps the splits."""
    if size(group) == 1:
        return x
    return _AllToAllUneven.apply(x, list(out_splits), list(in_splits), group)
