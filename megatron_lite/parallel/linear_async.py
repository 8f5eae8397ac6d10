"""The tensor-parallel linear as one autograd function, with its communication overlapped with
the backward GEMMs, the weight gradient accumulated into fp32 `main_grad`, and an optional
deferred weight-gradient GEMM (the idea of Megatron's linear with gradient accumulation and
asynchronous communication; our own code).

    forward                            backward (each wait as late as possible)
    x̂ = AG(x)  (input_comm "gather")   start AG(x) again      ‖ dgrad  g_x̂ = g·W
    x̂ = x      ("all_reduce", "none")  start RS(g_x̂) / AR(g_x̂) ‖ wgrad  g_W = gᵀ·x̂ (or queued)
    y = x̂·Wᵀ + b                       wait

With sequence parallelism ("gather") only the local shard x [s/tp, b, h] is saved for backward,
not x̂ [s, b, h]. "all_reduce" is the column-parallel layer without SP (identity forward,
all-reduced input gradient); "none" is the row-parallel layer (its collective follows it).

Gradient accumulation fusion: when the weight has `main_grad` (data_parallel/buffers.py), g_W
is added into it and autograd gets `weight.main_grad_placeholder` as the weight's gradient: a
defined zero-stride zeros tensor the buffer made (one 0-dim element, no weight-sized memory),
never None. Defined, so the weight's AccumulateGrad node runs on the device's autograd thread in
backward order, like every other gradient (an undefined input sends it to the CPU thread, where
the buffer's bookkeeping would race the device thread and launch buckets in a timing-dependent
order); the buffer's pre-hook on that node recognises it and keeps autograd from storing it.
(Megatron returns a dummy weight-sized gradient for the same reason; the planner counts no
weight-sized tensor here, plan/working.py.) A weight with `main_grad` but no placeholder (set
by hand, no buffer) gets None as before. A weight with `ensure_main_grad` (ZeRO-2, whose
buckets have storage only while they accumulate) gets it called before every write. FSDP2
parameters have no `main_grad`, and a weight with gradient hooks (`register_hook`) must show
them its gradient: for both g_W is returned as usual.

Deferred wgrad: with a `wgrad_queue` (a caller-owned list) captured at forward, backward does not
run the wgrad GEMM but appends a closure that does; `run_wgrads(queue)` runs them later. The
weight counts its closures queued (`wgrad_queued`) and run (`wgrad_done`); while some are still
to run the gradient buffer does not count the weight as ready, and each closure that runs calls
`weight.after_wgrad()` (set by the buffer) so its bucket launches once complete: run the
closures before the buffer's `finish()`. The backward hands autograd the placeholder there too
(where the closure will write main_grad).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from megatron_lite.parallel import compiled_comm, mappings

INPUT_COMMS = ("gather", "all_reduce", "none")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's, else the input's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _has_grad_hooks(weight: torch.Tensor) -> bool:
    """Whether `weight.register_hook` hooks are set (torch keeps them in `_backward_hooks`)."""
    return bool(getattr(weight, "_backward_hooks", None))


def _placeholder(weight: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd gets for a weight whose g_W went into main_grad (module docstring)."""
    return getattr(weight, "main_grad_placeholder", None)


def _weight_grad(weight: torch.Tensor, g2d: torch.Tensor, x2d: torch.Tensor, fuse: bool, fp8=None):
    """gᵀ·x̂ [out, in] (an FP8 GEMM with `fp8`, a parallel.fp8.Fp8Gemm), or, when `fuse` and
    the weight has `main_grad`, added into it (the placeholder returned)."""
    main = getattr(weight, "main_grad", None) if fuse else None
    if fp8 is not None:  # bf16 out of the FP8 GEMM, fp32 accumulation
        grad = fp8.wgrad(g2d, x2d)  # [out, in]
        if main is None:
            return grad.to(weight.dtype)
        if getattr(weight, "ensure_main_grad", None) is not None:
            weight.ensure_main_grad()
        main.add_(grad)
        return _placeholder(weight)
    if main is None:
        return g2d.t().mm(x2d).to(weight.dtype)
    ensure = getattr(weight, "ensure_main_grad", None)
    if ensure is not None:  # ZeRO-2: the bucket gets storage, no reduce-scatter of it in flight
        ensure()
    if g2d.dtype == main.dtype:
        main.addmm_(g2d.t(), x2d)  # the GEMM accumulates straight into the fp32 buffer
    else:  # bf16 GEMM, fp32 accumulation (what the buffer does with a returned gradient)
        main.add_(g2d.t().mm(x2d))
    return _placeholder(weight)


def _queue_wgrad(queue: list, weight, g2d: torch.Tensor, x2d: torch.Tensor, fp8=None) -> None:
    weight.wgrad_queued = getattr(weight, "wgrad_queued", 0) + 1  # ever (run: wgrad_done)

    @torch.no_grad()  # run by the caller, outside backward
    def wgrad() -> None:
        # into main_grad whenever there is one: the buffer's hook has run, it would miss .grad
        if getattr(weight, "main_grad", None) is not None:
            _weight_grad(weight, g2d, x2d, fuse=True, fp8=fp8)
        else:
            grad = _weight_grad(weight, g2d, x2d, fuse=False, fp8=fp8)
            weight.grad = grad if weight.grad is None else weight.grad + grad
        weight.wgrad_done = getattr(weight, "wgrad_done", 0) + 1
        done = getattr(weight, "after_wgrad", None)  # a gradient buffer counts what is ready
        if done is not None:
            done()

    queue.append(wgrad)


def _wait_unless_overlap(
    work: mappings.AsyncWork | None, overlap: bool
) -> mappings.AsyncWork | None:
    """Without overlap, wait for `work` at once (the comparison point for the benchmark)."""
    if work is not None and not overlap:
        work.wait()
    return work


class _ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, input_comm, overlap, wgrad_queue, fuse, fp8):
        ctx.in_dtype, ctx.fp8 = x.dtype, fp8
        dtype = _compute_dtype(x)
        x = x.to(dtype).contiguous()  # [s/tp, b, h] ("gather") or [s, b, h]
        # cast before the gather: the same values, in the compute dtype's bytes
        total = mappings.all_gather_dim0(x, group) if input_comm == "gather" else x  # [s, b, h]
        b = None if bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            if fp8 is None:
                y = F.linear(total, weight.to(dtype), b)  # [s, b, out/tp]
            else:  # the weight as stored, straight to FP8 (no bf16 copy in between)
                y = fp8.forward(total.reshape(-1, total.shape[-1]), weight)  # [s·b, out/tp]
                y = y.view(*total.shape[:-1], -1)  # [s, b, out/tp]
                y = y if b is None else y + b
        # the local shard, not `total`; the weight as itself: its main_grad / wgrad_queued
        # attributes are read in backward, and a saved-tensor hook (recompute, the activation
        # meter) would unpack a new tensor without them
        ctx.save_for_backward(x)
        ctx.weight = weight
        ctx.group, ctx.input_comm, ctx.overlap, ctx.queue = group, input_comm, overlap, wgrad_queue
        ctx.has_bias, ctx.fuse = bias is not None, fuse
        return y

    @staticmethod
    def backward(ctx, g):  # g: [s, b, out/tp]
        (x,), weight = ctx.saved_tensors, ctx.weight
        group, comm, overlap = ctx.group, ctx.input_comm, ctx.overlap
        gathering = None
        total = x
        if comm == "gather":  # re-gather the input while the dgrad GEMM runs
            total = x.new_empty((x.shape[0] * mappings.size(group), *x.shape[1:]))  # [s, b, h]
            gathering = _wait_unless_overlap(
                mappings.all_gather_async(total, x, group, "all_gather"), overlap
            )
        g = g.contiguous()
        if ctx.fp8 is None:
            grad_x = g.matmul(weight.to(g.dtype))  # [s, b, h] partial sums over TP
        else:
            grad_x = ctx.fp8.dgrad(g.reshape(-1, g.shape[-1]), weight).view(*g.shape[:-1], -1)
        grad_x = grad_x.to(ctx.in_dtype)
        reducing = None
        if comm == "gather":
            gathering.wait()
            shard = grad_x.new_empty(x.shape)  # [s/tp, b, h]
            reducing = mappings.reduce_scatter_async(shard, grad_x, group, "reduce_scatter")
            grad_x = shard
        elif comm == "all_reduce":
            reducing = mappings.all_reduce_async(grad_x, group, "all_reduce")
        _wait_unless_overlap(reducing, overlap)
        g2d, x2d = g.reshape(-1, g.shape[-1]), total.reshape(-1, total.shape[-1])
        grad_b = g2d.sum(0) if ctx.has_bias else None
        grad_w = None
        if ctx.queue is not None:
            _queue_wgrad(ctx.queue, weight, g2d, x2d, ctx.fp8)
            if getattr(weight, "main_grad", None) is not None:  # the closure will write it
                grad_w = _placeholder(weight)
        else:  # overlaps the reduction of grad_x
            grad_w = _weight_grad(weight, g2d, x2d, ctx.fuse, ctx.fp8)
        if reducing is not None:
            reducing.wait()
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group,
    *,
    input_comm: str,
    overlap: bool = True,
    wgrad_queue: list | None = None,
    accumulate_main_grad: bool = True,
    fp8=None,
) -> torch.Tensor:
    """y = x̂·Wᵀ + b with x̂ = all_gather(x) along dim 0 ("gather"; x [s/tp, b, h]) or x itself
    ("all_reduce": its gradient is all-reduced over `group`; "none"). See the module docstring;
    `accumulate_main_grad=False` returns the weight gradient even where `main_grad` exists
    (a queued wgrad goes into `main_grad` all the same: the buffer's hook has run by then).
    `fp8` (a parallel.fp8.Fp8Gemm) runs the three GEMMs in FP8 (parallel/fp8.py).
    """
    if input_comm not in INPUT_COMMS:
        raise ValueError(f"input_comm={input_comm!r}: expected one of {INPUT_COMMS}")
    if mappings.size(group) == 1:
        input_comm = "none"
    if compiled_comm.compiling() and wgrad_queue is None:
        return _traced_linear(x, weight, bias, group, input_comm)
    fuse = accumulate_main_grad and not _has_grad_hooks(weight)
    return _ParallelLinear.apply(
        x, weight, bias, group, input_comm, overlap, wgrad_queue, fuse, fp8
    )


def _traced_linear(x, weight, bias, group, input_comm: str) -> torch.Tensor:
    """parallel_linear inside a compiled region (model.compile): the same product built from
    mappings' conjugate collectives, its backward derived by AOTAutograd. It differs from the
    eager function in what backward does, not in the numbers: the gathered input x̂ [s, b, h]
    is saved (not re-gathered), the weight gradient is returned to autograd (the gradient
    buffer's hook adds it into main_grad), and there is no deferred wgrad (a B/W-splitting
    schedule runs the linears eagerly: models/compile.py)."""
    dtype = _compute_dtype(x)
    x = x.to(dtype)
    if input_comm == "gather":
        x = mappings.gather_from_sequence_parallel_region(x, group)  # [s/tp, b, h] -> [s, b, h]
    elif input_comm == "all_reduce":
        x = mappings.copy_to_tensor_parallel_region(x, group)
    b = None if bias is None else bias.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, weight.to(dtype), b)  # [s, b, out/tp]


@contextlib.contextmanager
def defer_wgrad(module: torch.nn.Module, queue: list) -> Iterator[list]:
    """Forwards run inside queue the wgrad GEMMs of every parallel linear in `module` (layers
    with a `wgrad_queue` attribute) into `queue` at backward, instead of running them."""
    layers = [m for m in module.modules() if hasattr(m, "wgrad_queue")]
    before = [m.wgrad_queue for m in layers]
    for m in layers:
        m.wgrad_queue = queue
    try:
        yield queue
    finally:
        for m, q in zip(layers, before, strict=True):
            m.wgrad_queue = q


def run_wgrads(queue: list[Callable[[], None]]) -> None:
    """Run the queued wgrad GEMMs in order (they accumulate into main_grad or .grad)."""
    while queue:
        queue.pop(0)()
