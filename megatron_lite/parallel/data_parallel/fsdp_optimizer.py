"""The optimizer (an `OptimizerSpec`, optimizer_spec.py) over FSDP2's sharded (DTensor)
parameters, with the checkpoint interface of `ShardedOptimizer` (ZeRO-3's side of
`state_shards`). Elementwise specs run here (any rows will do); one that needs whole matrices
runs in fsdp_whole_matrix.py.

The sharded fp32 parameters are the master weights. Checkpoints write and read this rank's
rows of each parameter and of its states where they are (nothing is gathered): the weights in
`weight_dtype`, the compute dtype the other stages store the model in (bf16 under
train.precision=bf16, with the fp32 masters beside them).
"""

from __future__ import annotations

import math

import torch

from megatron_lite.parallel import fake
from megatron_lite.parallel.data_parallel.interface import StateShard
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    init_states,
    make_optimizer,
    tensor_groups,
)
from megatron_lite.parallel.params import fsdp_replicas, fsdp_rows


class FSDPOptimizer:
    """The spec's torch optimizer on the DTensor parameters (its parameter groups rule reads
    them; AdamW: per tensor on CPU, fused on CUDA), with the checkpoint interface of
    `ShardedOptimizer`."""

    def __init__(
        self, params, spec: OptimizerSpec, hyper: dict, param_dtype: torch.dtype, names=None
    ):
        self.params, self.param_dtype, self.spec = params, param_dtype, spec
        fused = any(p.is_cuda for p in params) or fake.active()
        names = names or {}
        named = [(p, p, names.get(id(p), "")) for p in params]
        self.inner = make_optimizer(spec, named, hyper, fused)
        self.group_of = tensor_groups(self.inner)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()

    @property
    def masters(self) -> list[torch.Tensor]:
        """None kept apart: the fp32 shards are the masters."""
        return []

    @property
    def keeps_masters(self) -> bool:
        """Whether the weights compute in a lower precision than the fp32 shards (masters)."""
        return self.param_dtype != torch.float32

    # ------------------------------------------------------------ checkpoints
    @property
    def weight_dtype(self) -> torch.dtype:
        return self.param_dtype

    @torch.no_grad()
    def state_shards(self) -> list[StateShard]:
        """Each parameter's states over this rank's rows of it (`params.fsdp_rows`), created
        as the optimizer would at its first step when no step has run yet. The fp32 masters
        are the parameters themselves (checkpoints read them from there)."""
        fused = bool(self.inner.param_groups[0].get("fused"))
        out = []
        for p in self.params:
            state = self.inner.state[p]
            if not state:  # what the optimizer's first step would create
                step = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state.update(step=step, **init_states(self.spec, p, self.group_of[id(p)]))
            start, end = fsdp_rows(p)
            inner = math.prod(p.shape[1:])
            names = (s.name for s in self.spec.group_states(self.group_of[id(p)]))
            states = {k: state[k].to_local().view(-1) for k in names}
            out.append(
                StateShard(p, start * inner, end * inner, states, state["step"], fsdp_replicas(p))
            )
        return out

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """The sharded parameters are the masters; the weights they stand for are the model's,
        in the compute dtype: round them to it, so masters drawn in fp32 start from the bf16
        weights (as stages 0-2's masters copy the bf16 parameters; a no-op after a load)."""
        if self.keeps_masters:
            for p in self.params:
                local = p.to_local()
                local.copy_(local.to(self.param_dtype))
