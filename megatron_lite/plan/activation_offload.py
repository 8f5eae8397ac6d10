"""Activation CPU offload in the planner (model.activation_offload, parallel/activation_offload.py):
the bytes one layer offloads per microbatch, measured on the real layer; and for a pipeline
stage, the device bytes it saves at the peak, the host bytes it holds, the host-link bytes it
moves per step, and whether the copies hide behind the layers' compute.

`layer_offload_bytes` runs one real transformer layer forward on fake tensors at the layout's
local shapes (plan/saved.py's fake stage), with saved-tensor hooks around the parts the layer's
`offload_parts()` names, and counts what the offloader would move: the distinct tensor views
each part saves, weights, tensors under model.activation_offload_min_bytes and recomputed
regions left out (tests compare it with a real CPU run's offload/bytes).

`stage_offload` / `offload_plan` are the arithmetic on one pipeline rank (each figure per
rank), read from its schedule table (`table_counts`, any schedule: no schedule is named here):
- PCIe bytes per step = 2 (to the host and back) · B · Σ over the table's forwards of the
  chunk's layers, less one when that forward's backward is next (the engine's
  `backward_follows`: that last layer stays), with B a layer's offloaded bytes; e.g. 1F1B:
  2·B·(m·L − n_next), n_next = m on the last stage and 0 on the others;
- host peak = B · the most offloaded layers held at once, walking the table (a forward adds
  its layers at its end, its backward takes them back): 1F1B stage r holds min(m, pp − r)
  microbatches' L layers after its warmup;
- device bytes saved at the peak = the host peak (the reloads start with the backward);
- the copies hide when a layer's copy, B / host-link bandwidth each way (the link is full
  duplex), fits in the compute it overlaps: the next layer's forward for the copy out, the
  layer's backward (≈ 2× its forward) for the copy back; the forward binds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.config import Config
from megatron_lite.pipeline.actions import Action
from megatron_lite.pipeline.engine import backward_follows
from megatron_lite.pipeline.schedules import get_schedule, get_schedule_spec, virtual_stage
from megatron_lite.plan import modules
from megatron_lite.plan.saved import _fake_stage, _to_training_dtype
from megatron_lite.resolve import moe_layer_pattern, num_microbatches, stage_layers


@dataclass(frozen=True)
class OffloadPlan:
    """One stage's activation offload figures, per rank (module docstring)."""

    layer_bytes: float  # B: one layer's offloaded bytes per microbatch
    pcie_bytes_per_step: float  # to the host and back, over the step
    host_peak_bytes: float
    device_bytes_saved: float  # at the stage's activation peak
    copy_s: float  # one layer's copy, one direction
    layer_forward_s: float  # the compute the copy out overlaps
    hidden: bool  # copy_s <= layer_forward_s


def offload_plan(
    layer_bytes: float,
    moved_layers: int,
    peak_layers: int,
    layer_forward_s: float,
    host_gbps: float,
) -> OffloadPlan:
    """The figures of a stage whose step offloads `moved_layers` layer-microbatches, at most
    `peak_layers` of them on the host at once (`table_counts`); layer_forward_s: one layer's
    forward time; host_gbps: the host link's GB/s per direction per GPU (PCIe 5 x16: ~55)."""
    if host_gbps <= 0:
        raise ValueError(f"host_gbps={host_gbps}: the host link's bandwidth must be > 0")
    copy_s = layer_bytes / (host_gbps * 1e9)
    return OffloadPlan(
        layer_bytes=layer_bytes,
        pcie_bytes_per_step=2 * layer_bytes * moved_layers,
        host_peak_bytes=layer_bytes * peak_layers,
        device_bytes_saved=layer_bytes * peak_layers,
        copy_s=copy_s,
        layer_forward_s=layer_forward_s,
        hidden=copy_s <= layer_forward_s,
    )


def table_counts(actions: list[Action], chunk_layers: list[int]) -> tuple[int, int]:
    """(layer-microbatches offloaded over the step, the most on the host at once) of one
    rank's schedule table; chunk_layers[c]: the layers of its local chunk c. A forward offloads
    its chunk's layers but the last when its backward is next (engine.backward_follows); they
    are on the host from its end to its backward."""
    next_ = backward_follows(actions)
    moved = held = peak = 0
    for a in actions:
        if a.kind not in ("forward", "backward"):
            continue
        key = (a.microbatch, a.chunk)
        n = chunk_layers[a.chunk] - (key in next_)
        if a.kind == "forward":
            moved, held = moved + n, held + n
            peak = max(peak, held)
        else:
            held -= n
    return moved, peak


def stage_offload(
    cfg: Config,
    pp_rank: int,
    layer_forward_s: float,
    host_gbps: float,
    moe: bool | None = None,
    kernels: str = "fused",
) -> OffloadPlan:
    """`offload_plan` of pipeline rank `pp_rank` under cfg (resolved: parallel.dp set): its
    schedule table, its chunks' layers, one layer's measured bytes (an MoE layer's when
    `moe`; None: when every layer is one; `kernels`: fused, what a GPU runs, or torch, what
    the CPU runs)."""
    if moe is None:
        moe = bool(cfg.model.num_experts) and all(moe_layer_pattern(cfg.model))
    p = cfg.parallel
    m = num_microbatches(cfg.train, p.dp)
    spec = get_schedule_spec(p.pipeline_schedule, p.vpp)
    actions = get_schedule(p.pp, pp_rank, m, p.vpp, p.pipeline_schedule)
    layers = stage_layers(cfg.model, p)
    chunk_layers = [layers[virtual_stage(pp_rank, c, p.pp, spec.placement)] for c in range(p.vpp)]
    moved, peak = table_counts(actions, chunk_layers)
    b = layer_offload_bytes(cfg, moe, kernels) if cfg.model.activation_offload else 0.0
    return offload_plan(b, moved, peak, layer_forward_s, host_gbps)


def layer_offload_bytes(cfg: Config, moe: bool = False, kernels: str = "fused") -> float:
    """Bytes one layer (an MoE layer's when `moe`) offloads per microbatch on one rank under
    cfg.model.activation_offload, measured on fake tensors at cfg's micro batch."""
    question = ("layer_offload_bytes", moe, kernels)
    return modules.per_config(cfg, question, lambda: _measure(cfg, moe, kernels))


def _measure(cfg: Config, moe: bool, kernels: str) -> float:
    from megatron_lite.parallel import recompute

    names = set(cfg.model.activation_offload)
    min_bytes = max(cfg.model.activation_offload_min_bytes, 1)
    total, seen, stack = [0], set(), []
    with _fake_stage(cfg, kernels) as (config, mesh, tracker, chunk, inputs):
        layer = modules.new_layer(config, mesh, tracker, modules.layer_number(config, moe))
        _to_training_dtype(layer, cfg.train.precision)
        weights = {id(q) for q in layer.parameters()}

        def pack(t: torch.Tensor):
            base = t._base if t._base is not None else t
            weight = id(t) in weights or id(base) in weights or recompute.in_region()
            key = (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride())
            nbytes = t.numel() * t.element_size()
            if not weight and nbytes >= min_bytes and key not in seen:
                seen.add(key)
                total[0] += nbytes
            return t

        def pre(*_):
            stack.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            stack[-1].__enter__()

        def post(*_):
            stack.pop().__exit__(None, None, None)
            seen.clear()

        handles = []
        for name, m in layer.offload_parts().items():
            if name in names:
                handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        x, ctx = inputs(cfg.train.micro_batch_size)
        layer(x, ctx)
        for h in handles:
            h.remove()
    return float(total[0])


def offload_report(cfg: Config, node, layer_forward_s: float, host_gbps: float | None,
                   kernels: str = "fused") -> str:  # fmt: skip
    """`plan`'s lines for model.activation_offload: per pipeline rank the device bytes saved at
    the peak (already out of the memory table's activations), the host bytes held, the
    host-link bytes per step, and one layer's copy against its forward over the GPU's host
    link (`host_gbps`; None: the GPU's PCIe generation, plan/hardware.py PCIE_GBPS)."""
    from megatron_lite.plan.hardware import PCIE_GBPS

    gbps = host_gbps if host_gbps is not None else PCIE_GBPS[node.gpu.pcie_gen]
    gib = 2**30
    lines = [f"activation offload of {', '.join(cfg.model.activation_offload)} "
             f"over a {gbps:g} GB/s host link per GPU per direction:"]  # fmt: skip
    for rank in range(cfg.parallel.pp):
        o = stage_offload(cfg, rank, layer_forward_s, gbps, kernels=kernels)
        hides = "hidden" if o.hidden else "NOT hidden (the step waits for the copies)"
        lines.append(
            f"  pp rank {rank}: device -{o.device_bytes_saved / gib:.2f} GiB at the peak, host "
            f"{o.host_peak_bytes / gib:.2f} GiB, {o.pcie_bytes_per_step / 1e9:.1f} GB over "
            f"the link per step; a layer's copy {o.copy_s * 1e3:.2f} ms vs its forward "
            f"{o.layer_forward_s * 1e3:.2f} ms: {hides}"
        )
    return "\n".join(lines)
