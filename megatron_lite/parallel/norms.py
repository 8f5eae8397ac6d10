"""RMSNorm / LayerNorm over the last dim, through the fused kernels.

With sequence parallelism the input is a sequence shard [s/tp, b, h], so each TP rank's weight
gradient covers different tokens: the weights are marked `sequence_parallel` and gradient
finalization all-reduces them over TP.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite import kernels
from megatron_lite.parallel.params import set_meta


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = set_meta(
            nn.Parameter(torch.empty(hidden_size)),
            full_shape=(hidden_size,),
            init="ones",
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """[..., h] -> [..., h]; with `residual`, normalizes x + residual and returns
        (normed, x + residual)."""
        if residual is not None and x.dtype != residual.dtype:
            x = x.to(residual.dtype)  # a bf16 branch output joins an fp32 residual stream
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = set_meta(
            nn.Parameter(torch.empty(hidden_size)),
            full_shape=(hidden_size,),
            init="ones",
            sequence_parallel=sequence_parallel,
        )
        self.bias = set_meta(
            nn.Parameter(torch.empty(hidden_size)),
            full_shape=(hidden_size,),
            init="zeros",
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        total = x + residual
        return kernels.layer_norm(total, self.weight, self.bias, self.eps), total
