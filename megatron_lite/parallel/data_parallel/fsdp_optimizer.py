"""AdamW over FSDP2's sharded (DTensor) parameters, and the logical per-parameter states that
checkpoints hold whatever the stage (ZeRO-3's side of `ShardedAdamW.full_states`).

The sharded fp32 parameters are the master weights. Checkpoints see whole local tensors (this
rank's TP/EP shard of each parameter, gathered over the FSDP mesh): `full_weights()` hands them
out keyed by id(parameter), in the compute dtype the other stages store the model in (bf16
under train.precision=bf16, with the fp32 masters beside them), and `load_full_weights()` takes
them back into the shards.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from megatron_lite.parallel.data_parallel.optimizer import MOMENTS, adamw
from megatron_lite.parallel.params import fsdp_rows


def _shard_of(full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard of `full` (a whole local tensor) for the DTensor parameter `p`, the
    rows FSDP2 gives this rank (`params.fsdp_rows`), with no communication. Cut where `full`
    lives (the host, after a load): only the shard moves to the parameter's device."""
    start, end = fsdp_rows(p)
    return full[start:end].to(p.device, torch.float32)


def _like(p: torch.nn.Parameter, local: torch.Tensor) -> DTensor:
    """A DTensor laid out as `p` holding this rank's shard `local` (an AdamW moment)."""
    return DTensor.from_local(
        local.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
    )


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
    @torch.no_grad()
    def full_weights(self, gather: bool = True) -> dict[int, torch.Tensor]:
        """id(param) -> the whole local tensor in the compute dtype (collective); with
        gather=False uninitialized tensors of that shape, for a load to fill."""
        if not gather:
            return {id(p): torch.empty(p.shape, dtype=self.param_dtype) for p in self.params}
        # to the host one parameter at a time: the whole model never sits on the device
        return {id(p): p.full_tensor().to("cpu", self.param_dtype) for p in self.params}

    @torch.no_grad()
    def load_full_weights(self, weights: dict[int, torch.Tensor]) -> None:
        """The inverse of full_weights (masters then start from the loaded weights)."""
        for p in self.params:
            if id(p) in weights:
                p.to_local().copy_(_shard_of(weights[id(p)], p))

    @torch.no_grad()
    def full_states(self, with_master: bool) -> dict[int, dict[str, torch.Tensor]]:
        """id(param) -> {"exp_avg", "exp_avg_sq", "step"[, "master"]}, whole local tensors
        gathered from the shards (collective). The fp32 master is included when asked or when
        the weights compute in bf16 (the parameters the caller sees are the fp32 shards)."""
        out = {}
        for p in self.params:  # gathered one parameter at a time, kept on the host
            state = self.inner.state.get(p, {})
            mine = {
                k: state[k].full_tensor().cpu() if k in state else torch.zeros(p.shape)
                for k in MOMENTS
            }
            if with_master or self.keeps_masters:
                mine["master"] = p.full_tensor().cpu()
            if "step" in state:
                mine["step"] = state["step"].detach().clone()
            out[id(p)] = mine
        return out

    @torch.no_grad()
    def load_full_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """The inverse of full_states: each parameter takes its shard of the moments and, when
        the checkpoint has one, of the fp32 master (else it keeps the loaded weights)."""
        fused = bool(self.inner.param_groups[0].get("fused"))
        for p in self.params:
            state = states.get(id(p))
            if state is None:
                continue
            mine = {k: _like(p, _shard_of(state[k], p)) for k in MOMENTS}
            mine["step"] = state["step"].to(p.device if fused else "cpu", copy=True)
            self.inner.state[p] = mine
            if "master" in state:
                p.to_local().copy_(_shard_of(state["master"], p))

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """The sharded parameters are the masters; the weights they stand for are the model's,
        in the compute dtype: round them to it, so masters drawn in fp32 start from the bf16
        weights (as stages 0-2's masters copy the bf16 parameters; a no-op after a load)."""
        if self.keeps_masters:
            for p in self.params:
                local = p.to_local()
                local.copy_(local.to(self.param_dtype))
