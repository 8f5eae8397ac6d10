"""AdamW over this rank's shards of the gradient buffers, with fp32 master weights (Megatron's
distributed optimizer; ZeRO-0 is the same with one shard per rank holding everything).

Each (parameter ∩ this rank's shard) range is one piece: its master weight (the fp32 parameter
data itself when the model is fp32 and the state stays on the device; else an fp32 copy, on the
host under optimizer offload) and its gradient (a view of the reduced fp32 `main_grad` shard).
torch's AdamW steps the pieces (per tensor on CPU, so every layout does the same arithmetic per
element; fused on CUDA), then the updated masters are written back into the parameters' shards
and the buffers all-gather them (ZeRO-1/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.parallel import fake, mappings
from megatron_lite.parallel.data_parallel.buffers import GradBuffer
from megatron_lite.parallel.data_parallel.interface import StateShard

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    buffer: GradBuffer
    param: torch.nn.Parameter
    lo: int  # [lo, hi) in the buffer (inside the parameter's range and this rank's shard)
    hi: int
    grad_at: int  # where [lo, hi) starts in buffer.grad_shard
    master: torch.nn.Parameter  # fp32
    aliased: bool  # the master is the parameter's fp32 data itself (not a copy)

    @property
    def param_slice(self) -> torch.Tensor:
        return self.buffer.param_data[self.lo : self.hi]

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grad_shard[self.grad_at : self.grad_at + self.hi - self.lo]

    def offset(self) -> int:
        """Where the piece starts inside its parameter (flattened)."""
        return self.lo - self.buffer.ranges[id(self.param)].start


def make_pieces(buffers: list[GradBuffer], offload: bool) -> list[Piece]:
    pieces = []
    for buf in buffers:
        for _, (a, e), (c, _) in buf.shard_slices():
            for r in buf.ranges.values():
                lo, hi = max(a, r.start), min(e, r.start + r.param.numel())
                if lo >= hi:
                    continue
                data = buf.param_data[lo:hi]
                copy = data.dtype != torch.float32 or offload
                if copy:
                    host = torch.device("cpu") if offload else data.device
                    data = data.to(host, torch.float32, copy=True)
                    if offload and torch.cuda.is_available():
                        data = data.pin_memory()
                master = torch.nn.Parameter(data)
                pieces.append(Piece(buf, r.param, lo, hi, c + lo - a, master, not copy))
    return pieces


def adamw(decay, no_decay, lr, betas, eps, weight_decay) -> torch.optim.AdamW:
    """torch AdamW with weight decay on `decay` only (per tensor on CPU, fused on CUDA and in
    a dry run: the GPU's kernel, and the per-tensor path reads its step count on the host)."""
    on_cuda = any(p.is_cuda for p in [*decay, *no_decay]) or fake.active()
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
        eps=eps,
        foreach=False,
        fused=on_cuda or None,
    )


class ShardedAdamW:
    """AdamW over `pieces` (weight decay on pieces of parameters with dim >= 2)."""

    def __init__(self, pieces: list[Piece], lr, betas, eps, weight_decay, offload: bool):
        self.pieces, self.offload = pieces, offload
        decay = [pc.master for pc in pieces if pc.param.dim() >= 2]
        no_decay = [pc.master for pc in pieces if pc.param.dim() < 2]
        on_cuda = bool(pieces) and pieces[0].master.is_cuda
        self.inner = adamw(decay, no_decay, lr, betas, eps, weight_decay)
        for pc in pieces:  # states exist from the start, so memory is measured before step 1
            step = torch.zeros((), device=pc.master.device if on_cuda else "cpu")
            zeros = [
                torch.zeros_like(pc.master, memory_format=torch.preserve_format) for _ in MOMENTS
            ]
            self.inner.state[pc.master] = {"step": step, **dict(zip(MOMENTS, zeros, strict=True))}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for pc in self.pieces:
            g = pc.grad
            pc.master.grad = g.to(pc.master.device, non_blocking=True) if self.offload else g
        if self.offload and torch.cuda.is_available():  # the host copies must have landed
            torch.cuda.current_stream().synchronize()
        self.inner.step()
        for pc in self.pieces:
            if not pc.aliased:
                pc.param_slice.copy_(pc.master, non_blocking=True)
            pc.master.grad = None

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """After the parameters were loaded (checkpoint): masters that are copies follow."""
        for pc in self.pieces:
            if not pc.aliased:
                pc.master.copy_(pc.param_slice)

    # ------------------------------------------------------------ checkpoints
    @property
    def weight_dtype(self) -> torch.dtype:
        """The parameters' dtype (one for all of them, see builder._param_dtype)."""
        return self.pieces[0].param.dtype if self.pieces else torch.float32

    def state_shards(self) -> list[StateShard]:
        """Each piece's moments (and master, when it is a copy) over its range of the
        parameter. Identical copies: ZeRO-0's whole state on every rank of the buffer's group;
        with hybrid sharding, the shard on every rank of the replica group."""
        out = []
        for pc in self.pieces:
            state = self.inner.state[pc.master]
            states = {k: state[k] for k in MOMENTS}
            if not pc.aliased:
                states["master"] = pc.master.data
            buf = pc.buffer
            replicas = buf.group if buf.shard_size == 1 else buf.replica_group
            if replicas is not None and mappings.size(replicas) == 1:
                replicas = None
            lo, hi = pc.offset(), pc.offset() + pc.hi - pc.lo
            out.append(StateShard(pc.param, lo, hi, states, state["step"], replicas))
        return out
