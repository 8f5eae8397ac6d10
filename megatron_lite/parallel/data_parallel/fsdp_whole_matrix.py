"""ZeRO-3 (FSDP2) for an optimizer whose update needs whole matrices (`OptimizerSpec.elementwise`
False): FSDP2 keeps rows of each parameter on each rank, so every step each parameter is made
whole, updated by one rank and cut again.

- ownership: each parameter is owned by one rank of its sharding group (dp×cp, or edp for
  experts), by whole_matrix.assign's rule (largest first to the least-loaded rank, by elements);
- the owner keeps an fp32 copy of the whole parameter (its master while it steps) and the
  spec's states for it, so masters and states are about 1/N per rank as under ZeRO-1/2;
- step: for each parameter, its reduced gradient rows and its weight rows are all-gathered
  (DTensor.full_tensor), the owner steps it whole, broadcasts the result over the group, and
  every rank copies back its rows: about 12 bytes per element per step (fp32) beyond FSDP2's
  own traffic, one parameter at a time (so one whole parameter and its gradient are held at
  once; nothing overlaps: the simple version, a first step).

Hybrid sharding (dp_shard) and offload are refused for such specs (arguments.check_optimizer).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_lite.parallel import fake, mappings
from megatron_lite.parallel.data_parallel.interface import StateShard
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    init_states,
    make_optimizer,
)
from megatron_lite.parallel.data_parallel.whole_matrix import least_loaded
from megatron_lite.parallel.params import fsdp_rows


class FSDPWholeMatrixOptimizer:
    """The spec's optimizer on whole parameters gathered from FSDP2's shards, each stepped by
    its owner (module docstring); the checkpoint interface of `FSDPOptimizer` (the owner's
    states over the whole parameter, held by it alone)."""

    def __init__(self, params, spec: OptimizerSpec, hyper: dict, param_dtype: torch.dtype):
        self.params, self.param_dtype, self.spec = params, param_dtype, spec
        groups = [p.device_mesh.get_group(0) for p in params]  # 1-D: no hybrid sharding
        loads: dict[int, list[int]] = {}
        self.owner: dict[int, int] = {}  # id(param) -> its owner's rank in its group
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        for i in order:
            load = loads.setdefault(id(groups[i]), [0] * mappings.size(groups[i]))
            self.owner[id(params[i])] = least_loaded(load, params[i].numel())
        self.groups = {id(p): g for p, g in zip(params, groups, strict=True)}
        self.whole: dict[int, torch.nn.Parameter] = {}  # id(param) -> fp32 whole copy (owner)
        for p in params:
            if self._owns(p):
                local = p.to_local()
                self.whole[id(p)] = torch.nn.Parameter(torch.empty(p.shape, device=local.device))
        mine = [(self.whole[id(p)], p) for p in params if id(p) in self.whole]
        fused = any(w.is_cuda for w, _ in mine) or fake.active()
        self.inner = make_optimizer(spec, mine, hyper, fused)
        for w, _ in mine:  # states exist from the start (memory before step 1, checkpoints)
            step = torch.zeros((), device=w.device if w.is_cuda else "cpu")
            self.inner.state[w] = {"step": step, **init_states(spec, w)}

    def _owns(self, p) -> bool:
        group = self.groups[id(p)]
        me = dist.get_rank(group) if mappings.size(group) > 1 else 0
        return self.owner[id(p)] == me

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def masters(self) -> list[torch.Tensor]:
        """The owner's fp32 whole copies (the memory report's master term)."""
        return list(self.whole.values())

    @torch.no_grad()
    def step(self) -> None:
        """Per parameter: gather it, the owner steps it, broadcast, keep this rank's rows
        (module docstring). One parameter at a time, so the step holds one whole parameter
        and its gradient beyond the shards (the optimizer steps only the one with a grad)."""
        for p in self.params:
            if p.grad is None:
                continue
            grad, full = p.grad.full_tensor(), p.full_tensor()
            w = self.whole.get(id(p))
            if w is not None:
                w.copy_(full)
                w.grad = grad.to(torch.float32)
                self.inner.step()
                w.grad = None
                full.copy_(w)
            group = self.groups[id(p)]
            if mappings.size(group) > 1:
                src = dist.get_process_group_ranks(group)[self.owner[id(p)]]
                send = functools.partial(dist.broadcast, full, src, group)
                mappings.guarded("broadcast_dp", group, send)
            start, end = fsdp_rows(p)
            p.to_local().copy_(full[start:end])

    @property
    def keeps_masters(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.param_dtype

    def state_shards(self) -> list[StateShard]:
        """The owner's states of each of its parameters, over the whole parameter (no other
        rank holds them)."""
        out = []
        for p in self.params:
            if id(p) in self.whole:
                state = self.inner.state[self.whole[id(p)]]
                states = {k: state[k].view(-1) for k in self.spec.state_names}
                out.append(StateShard(p, 0, p.numel(), states, state["step"], None))
        return out

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """As FSDPOptimizer: round the fp32 shards to the compute dtype (the whole copies are
        refreshed from the shards at every step)."""
        if self.keeps_masters:
            for p in self.params:
                local = p.to_local()
                local.copy_(local.to(self.param_dtype))
