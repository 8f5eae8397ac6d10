"""The local experts: E/ep SwiGLU (or GeLU) MLPs with weights stacked [E_local, ...].

Two paths over the same weights, chosen by `grouped_gemm` (model.moe_grouped_gemm):
- grouped (the default): every local expert at once, one grouped matrix multiply per projection
  (`grouped_mm`: `torch._grouped_mm` with cumulative row offsets), the activation over all rows
  in one op. Exact work whatever the routing skew (each expert multiplies its own rows, no
  padding to the largest), empty experts cost nothing, and the number of ops dispatched does not
  grow with the number of experts.
- the loop: one pair of matmuls per expert over its block of rows, the reference path.

Measured on CPU, the experts alone (forward+backward, 1024 tokens, h=256, top-k·ffn=768, one
thread, 2-core shared machine), balanced / skewed (half the rows to one expert) routing, at
(E, k) = (8, 2), (64, 6), (256, 8): fp32 loop 96/97, 492/643, 14507/19882 ms, grouped 81/69,
96/105, 133/136 ms, bitwise equal; bf16 loop 1048/1116, 1445/2037, 3998/4410 ms, grouped
1003/1018, 1053/1725, 1237/1202 ms. The loop's backward also adds every expert's weight gradient
into a zero tensor of the whole stack (the backward of `weight[e]`), E² work. Grouped was never
slower, so it is the default; tools/bench_moe.py times the whole layer on 2 ranks.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.moe.fp8_grouped import fp8_grouped_mm
from megatron_lite.parallel import fake
from megatron_lite.parallel.fp8 import Fp8Gemm
from megatron_lite.parallel.params import set_meta

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm on a CPU


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU (fp32 math); float64 stays float64 so exactness tests stay exact."""
    if gate.dtype == torch.float64:
        return F.silu(gate) * up
    return kernels.swiglu(gate, up)


def native_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes x [N, a] and w [G, a, b]: torch has it, bf16 (on a
    CPU also fp32 and fp16; the CUDA kernel's rule, which torch's meta kernel states, is bf16),
    and every row 16-byte aligned (a and b multiples of 16 bytes)."""
    row = 16 // x.element_size()
    dtypes = _NATIVE_DTYPES if x.device.type == "cpu" else (torch.bfloat16,)
    return (
        hasattr(torch, "_grouped_mm")
        and x.dtype in dtypes
        and w.dtype == x.dtype
        and x.shape[-1] % row == 0
        and w.shape[-1] % row == 0
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, a] with rows grouped (group g: rows offsets[g-1] .. offsets[g]), w [G, a, b] (any
    strides), offsets [G] int32 cumulative with offsets[-1] = N -> [N, b]: each group's rows
    times its own matrix, in one op (differentiable in x and w).

    `torch._grouped_mm` where it takes the inputs (`native_grouped_mm`); otherwise (float64, fp32
    on a GPU, widths not a multiple of 16 bytes: exactness tests, tiny models) a block-sparse matmul
    that does the same exact work: row n of group g becomes a row of an [N, G·a] sparse matrix
    with x[n] at columns g·a ... (g+1)·a, times w as [G·a, b]. Under a dry run's fake tensors
    torch's meta kernel takes bf16 only (the CUDA kernel's rule), so other dtypes get
    `_ShapesOnlyGroupedMM`: the native op's outputs and saved tensors, no data."""
    if fake.is_fake(x) and not (native_grouped_mm(x, w) and x.dtype == torch.bfloat16):
        # (a fake tensor's device is the run's: fp32 on a CPU is native there, not in meta)
        return _ShapesOnlyGroupedMM.apply(x, w, offsets)
    if native_grouped_mm(x, w):
        return _DenseGrad.apply(torch._grouped_mm(x, w, offs=offsets))
    return _BlockSparseGroupedMM.apply(x, w, offsets)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: `torch._grouped_mm`'s backward
    rejects zero-stride ones (the expanded gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        return dy.contiguous()


class _ShapesOnlyGroupedMM(torch.autograd.Function):
    """A dry run's `torch._grouped_mm` where its meta kernel refuses the dtype: allocates and
    saves what the native op does (output [N, b]; x and w saved; gradients [N, a], [G, a, b])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x.new_empty(x.shape[0], w.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dy.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy.new_empty(w.shape) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _block_rows(x: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """x [N, a], group [N] -> sparse COO [N, G·a]: row n holds x[n] in group[n]'s block."""
    N, a = x.shape
    cols = (group * a).unsqueeze(1) + torch.arange(a, device=x.device)  # [N, a]
    rows = torch.arange(N, device=x.device).unsqueeze(1).expand(N, a)
    index = torch.stack([rows.reshape(-1), cols.reshape(-1)])  # [2, N·a], sorted
    return torch.sparse_coo_tensor(
        index, x.reshape(-1), (N, groups * a), is_coalesced=True, check_invariants=False
    )


class _BlockSparseGroupedMM(torch.autograd.Function):
    """`grouped_mm` for inputs `torch._grouped_mm` does not take; backward by the same
    construction: dx = blocks(dy) @ wᵀ as [G·b, a], dw = blocks(x)ᵀ @ dy (each group's
    x_gᵀ·dy_g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        G, a, b = w.shape
        rows = torch.arange(x.shape[0], device=x.device)
        group = torch.searchsorted(offsets.long(), rows, right=True)  # [N]
        ctx.save_for_backward(x, w, group)
        return torch.sparse.mm(_block_rows(x, group, G), w.reshape(G * a, b))  # [N, b]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, group = ctx.saved_tensors
        G, a, b = w.shape
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = w.transpose(1, 2).reshape(G * b, a)
            dx = torch.sparse.mm(_block_rows(dy, group, G), wt)  # [N, a]
        if ctx.needs_input_grad[1]:
            dw = torch.sparse.mm(_block_rows(x, group, G).t(), dy).view(G, a, b)
        return dx, dw, None


def expert_offsets(tokens_per_expert: list[int] | torch.Tensor, device) -> torch.Tensor:
    """Cumulative rows [E_local] int32 (the grouped GEMM's offsets) from the rows per expert, a
    host list (the dispatcher's) or an integer tensor on any device."""
    if isinstance(tokens_per_expert, torch.Tensor):
        return tokens_per_expert.to(device).cumsum(0, dtype=torch.int32)
    ends = list(itertools.accumulate(tokens_per_expert))
    # from the host: no stream sync on a GPU (the values are staged at once)
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


class LocalExperts(nn.Module):
    """Experts ep_rank·E/ep ... (ep_rank+1)·E/ep of `num_experts`, no biases.

    weight1 [E_local, 2·ffn, h] (gate, up; [E_local, ffn, h] without gating), weight2
    [E_local, h, ffn]. Their ParamMeta describes the full stacked tensor [E, ...] sharded along
    dim 0 over EP (the generic tp_* fields name that shard), so every EP degree initializes the
    same experts. With `sequence_parallel` each TP rank feeds its own token shard through the
    replicated experts, so their gradients are summed over TP. `grouped_gemm`: all experts in
    one grouped GEMM per projection (module docstring), else a loop over them.
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
        # FP8 grouped GEMMs (moe/fp8_grouped.py), set by models.fp8.apply_fp8
        self.fp8: Fp8Gemm | None = None
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
            matrix_rows=(ffn_hidden_size,) * (2 if gated else 1),
            **shard,
        )
        self.weight2 = set_meta(
            nn.Parameter(torch.empty(self.num_local, hidden_size, ffn_hidden_size)),
            full_shape=(num_experts, hidden_size, ffn_hidden_size),
            std=output_std,
            **shard,
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor) -> torch.Tensor:
        """x [N, h] grouped by local expert (block e has tokens_per_expert[e] rows, a host list
        or an integer tensor [E_local]) -> [N, h]."""
        if self.fp8 is not None and not fake.is_fake(x):
            return self._fp8(x, expert_offsets(tokens_per_expert, x.device))
        if not self.grouped_gemm:
            if isinstance(tokens_per_expert, torch.Tensor):
                tokens_per_expert = tokens_per_expert.tolist()
            return self._loop(x, tokens_per_expert)
        offsets = expert_offsets(tokens_per_expert, x.device)  # [E_local]
        dtype = x.dtype  # as F.linear: autocast's dtype where it is on
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        w1, w2 = self.weight1.to(dtype), self.weight2.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            h = grouped_mm(x.to(dtype), w1.transpose(1, 2), offsets)  # [N, 2·ffn]
            # [N, ffn]; fc1's output is not held through fc2 (the gate, up views die here)
            h = _swiglu(*h.chunk(2, dim=-1)) if self.gated else F.gelu(h)
            return grouped_mm(h, w2.transpose(1, 2), offsets)  # [N, h]

    def _fp8(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The grouped path with FP8 GEMMs, cast from the weights as stored."""
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            h = fp8_grouped_mm(x.to(dtype), self.weight1.transpose(1, 2), offsets)  # [N, 2·ffn]
            h = _swiglu(*h.chunk(2, dim=-1)) if self.gated else F.gelu(h)  # [N, ffn]
            return fp8_grouped_mm(h, self.weight2.transpose(1, 2), offsets)  # [N, h]

    def _loop(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """The reference path: one expert after another."""
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
