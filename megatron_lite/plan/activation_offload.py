"""Activation CPU offload in the planner (model.activation_offload, parallel/activation_offload.py):
the bytes one layer offloads per microbatch, measured on the real layer; and for a pipeline
stage, the device bytes it saves at the peak, the host bytes it holds, the host-link bytes it
moves per step, and whether the copies hide behind the layers' compute.

`layer_offload_bytes` runs one real transformer layer forward on fake tensors at the layout's
local shapes (plan/saved.py's fake stage), with saved-tensor hooks around the parts the layer's
`offload_parts()` names, and counts what the offloader would move: the distinct tensor views
each part saves, weights, tensors under model.activation_offload_min_bytes and recomputed
regions left out (tests compare it with a real CPU run's offload/bytes).

`offload_plan` is the arithmetic on one stage (each figure per rank):
- PCIe bytes per step = 2 (to the host and back) · B · (m·L − n_next), with B a layer's
  offloaded bytes, L the stage's layers, m the microbatches and n_next those whose backward
  follows their forward at once (the engine's `backward_follows`: their last layer stays);
- host peak = B · (f·L − [the last forward's backward is next]) with f the microbatches in
  flight at the stage's peak (1F1B: min(m, pp − stage)): every offloaded layer of every
  microbatch in flight sits on the host at the end of the last forward before a backward;
- device bytes saved at the peak = the host peak (the reload starts with that backward);
- the copies hide when a layer's copy, B / host-link bandwidth each way (the link is full
  duplex), fits in the compute it overlaps: the next layer's forward for the copy out, the
  layer's backward (≈ 2× its forward) for the copy back; the forward binds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.config import Config
from megatron_lite.plan import modules
from megatron_lite.plan.saved import _fake_stage, _to_training_dtype


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
    layers: int,
    microbatches: int,
    in_flight: int,
    backward_next: int,
    last_backward_next: bool,
    layer_forward_s: float,
    host_gbps: float,
) -> OffloadPlan:
    """The figures of a stage of `layers` layers over `microbatches`; in_flight: the most
    microbatches forwarded and not yet backwarded at its peak; backward_next: how many
    forwards have their backward next (engine.backward_follows); last_backward_next: whether
    the forward at the peak is one of them; layer_forward_s: one layer's forward time;
    host_gbps: the host link's GB/s per direction per GPU (e.g. 55 for PCIe 5 x16)."""
    if host_gbps <= 0:
        raise ValueError(f"host_gbps={host_gbps}: the host link's bandwidth must be > 0")
    moved = layer_bytes * (microbatches * layers - backward_next)
    host_peak = layer_bytes * (in_flight * layers - int(last_backward_next))
    copy_s = layer_bytes / (host_gbps * 1e9)
    return OffloadPlan(
        layer_bytes=layer_bytes,
        pcie_bytes_per_step=2 * moved,
        host_peak_bytes=host_peak,
        device_bytes_saved=host_peak,
        copy_s=copy_s,
        layer_forward_s=layer_forward_s,
        hidden=copy_s <= layer_forward_s,
    )


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
