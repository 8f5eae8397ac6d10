"""What one layer holds for a moment beyond what it saves, measured: its forward and backward
run on plan/saved.py's fake stage under a `MemoryTracker` (training/memory_tracker.py) that
samples the bytes alive after every op.

The layer runs as it does under ZeRO-0/1/2: each parameter has an fp32 `main_grad` (outside
the sample: the planner counts gradient buffers itself) and the hooks of
data_parallel/buffers.py as far as memory goes — a linear's weight gradient goes into
main_grad inside its backward (parallel/linear_async.py calls `ensure_main_grad` first, the
moment ZeRO-2 allocates the bucket), any other gradient reaches main_grad in the pre-hook of
its AccumulateGrad and autograd keeps nothing. Each sample records that state: the parameter
group (dense 0, expert 1) of the gradient arriving or last arrived, how many of that group's
gradients have arrived, the index of the one arriving (None between), and the bytes of the
arrived and arriving gradients (what ZeRO-3, with no main_grad, holds instead:
plan/working.py).

The forward's samples are the bytes of activations and temporaries alive (its input
included); before the backward the layer's output is released, as the pipeline engine does
once the next stage has it, and the output gradient is made. The backward's samples are the
bytes alive less the storages the saved-tensor meter still holds (whatever is saved and not
released yet) and less the output gradient (the planner's received gradient), beside the
meter's bytes still held.

Selective recompute of the attention core: the layer runs its regions as plain calls (one
forward measures every recompute choice, plan/saved.py), so what the core saves inside itself
is held from the forward here, where a recomputed core rebuilds it in the backward, when
autograd reaches the core (its output's node), and frees it there. `regions` names, per
region, the storages only its inside saves (those a recompute of it does not keep), and each
backward sample records how many of their bytes are held and whether the region's backward has
begun: `summary(..., selective)` counts them as the recompute has them: absent until then,
then working bytes (not saved ones) until freed.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from megatron_lite.pipeline.engine import deallocate_output
from megatron_lite.training.memory_tracker import MemoryTracker

WORKING = ("activations", "temporaries")  # the tracker's categories the samples count


class LayerTrace(MemoryTracker):
    """See the module docstring: `prepare(layer, others)`, run the forward inside the
    context, then `backward(output)`."""

    def __init__(self, meter):
        super().__init__()
        self.meter = meter  # the forward's SavedTensorMeter (its current_bytes: still held)
        self.forward_samples: list[int] = []
        self.backward_samples: list[tuple] = []
        self.recv = 0
        self._backward = False
        self._group, self._arriving = 0, None
        self._arrived = [0, 0]  # per group
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group, index in it)
        self._group_of: dict[int, int] = {}  # id(param) -> its group
        self._grads = [0, 0]  # (arrived, arriving) gradient bytes
        self._nodes: list = []
        # region -> {storage key: bytes} saved only inside it (set before the backward), and
        # the regions whose backward has begun (the recorder's output-node hooks add them)
        self.regions: dict[str, dict] = {}
        self.started: set[str] = set()

    def prepare(self, layer: torch.nn.Module, others=()) -> None:
        """Name what exists before the forward (the layer's parameters, buffers and `others`:
        the chunk's tables, the token context), give each parameter its main_grad and hooks."""
        from megatron_lite.parallel.params import meta_of

        params = [p for p in layer.parameters() if p.requires_grad]
        self.label(list(layer.parameters()), "weights")
        self.label([*layer.buffers(), *others], "buffers")
        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.main_grad_placeholder = torch.zeros((), dtype=p.dtype).expand(p.shape)
            self.label([p.main_grad, p.main_grad_placeholder], "grads")
            p.ensure_main_grad = lambda p=p: self._arrive(p)
            group = self._group_of[id(p)] = int(bool(meta_of(p).is_expert))
            node = get_gradient_edge(p).node
            hook = node.register_prehook(lambda grads, p=p, g=group: self._on_grad(p, g, grads))
            self._handles.append(hook)  # removed on exit (a later trace of the layer has its own)
            self._nodes.append(node)  # autograd holds a leaf's accumulator weakly
        self.forward_samples.clear()  # (the main_grads' allocation, before their label)

    def working(self) -> int:
        return sum(self.current[c] for c in WORKING)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._sample()
        return out

    def _sample(self) -> None:
        if not self._backward:
            self.forward_samples.append(self.working())
            return
        held = self.meter.current_bytes
        g = self._group
        inside = {
            r: (sum(n for k, n in keys.items() if self.meter.held(k)), r in self.started)
            for r, keys in self.regions.items()
        }
        self.backward_samples.append(
            (self.working() - held - self.recv, held, g, self._arrived[g], self._arriving,
             *self._grads, inside)
        )  # fmt: skip

    def _arrive(self, p: torch.nn.Parameter) -> None:
        """`p`'s gradient is about to be written (ensure_main_grad, or its pre-hook)."""
        g = self._group_of[id(p)]
        if id(p) not in self._index:
            self._index[id(p)] = (g, sum(1 for k in self._index.values() if k[0] == g))
        self._group, self._arriving = g, self._index[id(p)][1]
        self._grads[1] = p.numel() * p.element_size()
        self._sample()

    def _on_grad(self, p: torch.nn.Parameter, group: int, grads: tuple) -> tuple:
        grad = grads[0]
        if grad is not None and grad is not p.main_grad_placeholder:
            self._arrive(p)
            p.main_grad.add_(grad)
        if id(p) not in self._index:  # (no gradient reached it: it arrives all the same)
            self._index[id(p)] = (group, sum(1 for k in self._index.values() if k[0] == group))
        self._group, self._arriving = group, None
        self._arrived[group] += 1
        self._grads = [self._grads[0] + p.numel() * p.element_size(), 0]
        self._sample()
        return (None,)

    def backward(self, output: torch.Tensor) -> None:
        """Release the output's data, make its gradient, run the backward (samples)."""
        grad = torch.empty_like(output)
        self.recv = grad.untyped_storage().nbytes()
        deallocate_output(output)
        self._backward = True
        self._sample()
        torch.autograd.backward(output, grad)

    def summary(self, saved: float, fp32: bool, selective: tuple[str, ...] = ()) -> tuple:
        """(the forward's largest sample, {(group, arrived): (working, freed, arriving)} the
        backward's largest sample of each gradient state in arrival order, (working, freed)
        its largest under ZeRO-3 with every gradient made so far held, then (working, freed)
        with only the arriving one's: a later microbatch's), freed counted against `saved`,
        the bytes the layer's rows hold without recompute (plan/working.py); the regions of
        `selective` recomputed (the module docstring): their inside saves are not among the
        freed, their kept inputs that nothing else saves taken as held to the layer's end."""
        classes: dict[tuple, list] = {}
        zero3 = later = None
        totals = {r: sum(keys.values()) for r, keys in self.regions.items()}
        for sample in self.backward_samples:
            w, held, g, arrived, arriving, g_arrived, g_arriving, inside = sample
            freed = saved - held
            for r in selective:  # rebuilt once its backward begins; never among the saved
                held_r, begun = inside.get(r, (0, False))
                w += held_r if begun else 0
                freed += held_r - totals.get(r, 0)
            c = classes.get((g, arrived))
            if c is None or w - freed > c[0] - c[1]:
                classes[(g, arrived)] = [w, freed, (c is not None and c[2]) or arriving is not None]
            else:
                c[2] = c[2] or arriving is not None
            # without main_grad every gradient made so far is held (fp32: the GEMM's own too)
            own = g_arriving if fp32 else 0  # (bf16: the GEMM's product is in w already)
            w3 = w + g_arrived + own
            if zero3 is None or w3 - freed > zero3[0] - zero3[1]:
                zero3 = (w3, freed)
            # a later microbatch adds into the unsharded gradients (the planner's grads term):
            # only the arriving one's own is made
            if later is None or w + own - freed > later[0] - later[1]:
                later = (w + own, freed)
        forward = max(self.forward_samples, default=0)
        states = {k: tuple(v) for k, v in classes.items()}
        return forward, states, (*(zero3 or (0, 0)), *(later or (0, 0)))
