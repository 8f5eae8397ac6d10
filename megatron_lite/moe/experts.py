"""The local experts: E/ep SwiGLU (or GeLU) MLPs with weights stacked [E_local, ...].

Each expert runs as its own pair of matmuls over its contiguous block of tokens (a loop).
Measured on CPU (fp32, 1 thread, forward+backward): padding all experts to the largest block and
using one bmm was ~20-30% faster with perfectly balanced routing but up to 2.4x slower with a
4:1 skew (1024 tokens, h=256, ffn=704), since it computes E·max_count rows; the loop does exact
work whatever the balance, so we use the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.parallel.params import set_meta


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU (fp32 math); float64 stays float64 so exactness tests stay exact."""
    if gate.dtype == torch.float64:
        return F.silu(gate) * up
    return kernels.swiglu(gate, up)


class LocalExperts(nn.Module):
    """Experts ep_rank·E/ep ... (ep_rank+1)·E/ep of `num_experts`, no biases.

    weight1 [E_local, 2·ffn, h] (gate, up; [E_local, ffn, h] without gating), weight2
    [E_local, h, ffn]. Their ParamMeta describes the full stacked tensor [E, ...] sharded along
    dim 0 over EP (the generic tp_* fields name that shard), so every EP degree initializes the
    same experts. With `sequence_parallel` each TP rank feeds its own token shard through the
    replicated experts, so their gradients are summed over TP.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        ep_rank: int = 0,
        ep_size: int = 1,
        gated: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        output_std: float = 0.02,
        grouped_gemm: bool = True,
    ):
        super().__init__()
        self.grouped_gemm = grouped_gemm
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={ep_size}")
        self.num_local = num_experts // ep_size
        self.gated = gated
        fc1 = 2 * ffn_hidden_size if gated else ffn_hidden_size
        shard = dict(
            tp_dim=0,
            tp_rank=ep_rank,
            tp_size=ep_size,
            is_expert=True,
            sequence_parallel=sequence_parallel,
        )
        self.weight1 = set_meta(
            nn.Parameter(torch.empty(self.num_local, fc1, hidden_size)),
            full_shape=(num_experts, fc1, hidden_size),
            std=init_std,
            **shard,
        )
        self.weight2 = set_meta(
            nn.Parameter(torch.empty(self.num_local, hidden_size, ffn_hidden_size)),
            full_shape=(num_experts, hidden_size, ffn_hidden_size),
            std=output_std,
            **shard,
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x [N, h] grouped by local expert (block e has tokens_per_expert[e] rows) -> [N, h]."""
        outs = []
        for e, xe in enumerate(x.split(tokens_per_expert)):  # xe [n_e, h]
            h = F.linear(xe, self.weight1[e])  # [n_e, 2·ffn]
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = _swiglu(gate, up)
            else:
                h = F.gelu(h)
            outs.append(F.linear(h, self.weight2[e]))  # [n_e, h]
        return torch.cat(outs)
