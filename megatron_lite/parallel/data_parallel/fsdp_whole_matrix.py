"""ZeRO-3 (FSDP2) for the parameters whose update needs whole matrices (a group of an
`OptimizerSpec` that is not elementwise, e.g. Muon's): FSDP2 keeps rows of each parameter on
each rank, so every step each such parameter is made whole, updated by one rank and cut again.

- ownership: each parameter is owned by one rank of its sharding group (dp×cp, or edp for
  experts; with HSDP the shard group, each replica doing the same), by whole_matrix's
  `owner_table` (largest cost first to the least-loaded rank, `OptimizerSpec.cost`);
- the owner keeps an fp32 copy of the whole parameter (its master while it steps) and the
  spec's states for it, so masters and states are about 1/N per rank as under ZeRO-1/2;
- step: each parameter's reduced gradient rows and weight rows are all-gathered
  (DTensor.full_tensor, comm stats kind "gather_whole"), the owner keeps them; one optimizer
  step; each owner's result is broadcast over the group ("broadcast_dp") and every rank copies
  back its rows: 12 bytes per element per step (fp32) beyond FSDP2's own traffic. An owner
  holds the whole gradients of its parameters until the step (about 1/N of them).

The spec's elementwise groups (Muon's AdamW) step on their DTensor shards as in
fsdp_optimizer.py. Optimizer offload is refused for such specs (arguments.check_optimizer).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_lite.parallel import fake, mappings
from megatron_lite.parallel.data_parallel.interface import StateShard
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    init_states,
    make_optimizer,
    needs_whole,
    tensor_groups,
)
from megatron_lite.parallel.data_parallel.whole_matrix import owner_table
from megatron_lite.parallel.params import fsdp_replicas, fsdp_rows


class FSDPWholeMatrixOptimizer:
    """The spec's optimizer on whole parameters gathered from FSDP2's shards, each stepped by
    its owner (module docstring), and on the DTensor shards themselves for the groups whose
    update is elementwise (Muon's AdamW groups); the checkpoint interface of `FSDPOptimizer`
    (the owner's states over the whole parameter, held by it alone)."""

    def __init__(
        self, params, spec: OptimizerSpec, hyper: dict, param_dtype: torch.dtype, names=None,
        tp_group=None,
    ):  # fmt: skip
        self.params, self.param_dtype, self.spec = params, param_dtype, spec
        names = names or {}
        whole = needs_whole(spec, hyper, [(names.get(id(p), ""), p) for p in params])
        self.gathered = [p for p in params if whole[id(p)]]  # stepped whole by an owner
        # the sharding group: the last mesh dim (HSDP's replicas repeat the same work)
        groups = [p.device_mesh.get_group(p.device_mesh.ndim - 1) for p in self.gathered]
        self.groups = {id(p): g for p, g in zip(self.gathered, groups, strict=True)}
        self.owner: dict[int, int] = {}  # id(param) -> its owner's rank in its group
        cost = (lambda p: spec.cost(p, hyper)) if spec.cost else (lambda p: p.numel())
        for group in {id(g): g for g in groups}.values():
            mine = [p for p in self.gathered if self.groups[id(p)] is group]
            table = owner_table(mine, mappings.size(group), cost)
            self.owner.update({id(p): r for p, r in zip(mine, table, strict=True)})
        self.whole: dict[int, torch.nn.Parameter] = {}  # id(param) -> fp32 whole copy (owner)
        for p in self.gathered:
            if self._owns(p):
                local = p.to_local()
                self.whole[id(p)] = torch.nn.Parameter(torch.empty(p.shape, device=local.device))
        steps = [(self.whole[id(p)], p) for p in self.gathered if id(p) in self.whole]
        steps += [(p, p) for p in params if not whole[id(p)]]
        fused = any(t.is_cuda for t, _ in steps) or fake.active()
        named = [(t, p, names.get(id(p), "")) for t, p in steps]
        self.inner = make_optimizer(spec, named, hyper, fused, tp_group)
        self.group_of = tensor_groups(self.inner)
        for t, _ in steps:  # states exist from the start (memory before step 1, checkpoints)
            step = torch.zeros((), device=t.device if t.is_cuda else "cpu")
            self.inner.state[t] = {"step": step, **init_states(spec, t, self.group_of[id(t)])}

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
        """Every gathered parameter's gradient and weight made whole on its owner (all-gathers
        every rank of its group joins), one optimizer step (the owners' whole copies, the
        elementwise groups' shards), then each whole copy broadcast from its owner and every
        rank keeps its rows. An owner holds the whole gradients of its parameters until the
        step (about 1/N of them)."""
        for p in self.gathered:
            if p.grad is None:
                continue
            group = self.groups[id(p)]
            grad = mappings.gathered("gather_whole", group, p.grad.to_local(), p.grad.full_tensor)
            full = mappings.gathered("gather_whole", group, p.to_local(), p.full_tensor)
            w = self.whole.get(id(p))
            if w is not None:
                w.copy_(full)
                w.grad = grad.to(torch.float32)
        self.inner.step()
        for p in self.gathered:
            if p.grad is None:
                continue
            w = self.whole.get(id(p))
            if w is not None:
                full, w.grad = w.detach().to(p.dtype), None
            else:
                full = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
            group = self.groups[id(p)]
            if mappings.size(group) > 1:
                src = dist.get_process_group_ranks(group)[self.owner[id(p)]]
                mappings.broadcast(full, src, group, kind="broadcast_dp")
            start, end = fsdp_rows(p)
            p.to_local().copy_(full[start:end])

    @property
    def keeps_masters(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.param_dtype

    def state_shards(self) -> list[StateShard]:
        """The owner's states of each of its whole parameters, over the whole parameter (no
        other rank holds them); the elementwise groups' over this rank's rows (FSDPOptimizer)."""
        out = []
        for p in self.params:
            t = self.whole.get(id(p), None if id(p) in self.groups else p)
            if t is None:
                continue
            state = self.inner.state[t]
            names = [s.name for s in self.spec.group_states(self.group_of[id(t)])]
            if t is p:  # an elementwise group's shard, as FSDPOptimizer
                start, end = fsdp_rows(p)
                inner = math.prod(p.shape[1:])
                states = {k: state[k].to_local().view(-1) for k in names}
                shard = StateShard(p, start * inner, end * inner, states, state["step"],
                                   fsdp_replicas(p))  # fmt: skip
            else:
                states = {k: state[k].view(-1) for k in names}
                shard = StateShard(p, 0, p.numel(), states, state["step"], None)
            out.append(shard)
        return out

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """As FSDPOptimizer: round the fp32 shards to the compute dtype (the whole copies are
        refreshed from the shards at every step)."""
        if self.keeps_masters:
            for p in self.params:
                local = p.to_local()
                local.copy_(local.to(self.param_dtype))
