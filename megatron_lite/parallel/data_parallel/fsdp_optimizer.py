"""AdamW over FSDP2's sharded (DTensor) parameters, with the checkpoint interface of
`ShardedAdamW` (ZeRO-3's side of `state_shards`).

The sharded fp32 parameters are the master weights. Checkpoints write and read this rank's
rows of each parameter and of its moments where they are (nothing is gathered): the weights in
`weight_dtype`, the compute dtype the other stages store the model in (bf16 under
train.precision=bf16, with the fp32 masters beside them).
"""

from __future__ import annotations

import math

import torch

from megatron_lite.parallel.data_parallel.interface import StateShard
from megatron_lite.parallel.data_parallel.optimizer import MOMENTS, adamw
from megatron_lite.parallel.params import fsdp_replicas, fsdp_rows


class FSDPAdamW:
    """torch AdamW on the DTensor parameters (weight decay on matrices: p.dim() >= 2; per
    tensor on CPU, fused on CUDA), with the checkpoint interface of `ShardedAdamW`."""

    def __init__(self, params, lr, betas, eps, weight_decay, param_dtype: torch.dtype):
        self.params, self.param_dtype = params, param_dtype
        decay, no_decay = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
        self.inner = adamw(decay, no_decay, lr, betas, eps, weight_decay)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()

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
        """Each parameter's moments over this rank's rows of it (`params.fsdp_rows`), created
        as torch's AdamW would at its first step when no step has run yet. The fp32 masters
        are the parameters themselves (checkpoints read them from there)."""
        fused = bool(self.inner.param_groups[0].get("fused"))
        out = []
        for p in self.params:
            state = self.inner.state[p]
            if not state:  # what torch.optim.AdamW's first step would create
                step = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state.update(step=step, **{k: torch.zeros_like(p) for k in MOMENTS})
            start, end = fsdp_rows(p)
            inner = math.prod(p.shape[1:])
            states = {k: state[k].to_local().view(-1) for k in MOMENTS}
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
