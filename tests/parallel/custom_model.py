"""A model that is not ours, built only from megatron_lite's public building blocks (the README's
"Using the layers in your own model"): GPT-J-style blocks whose attention and MLP branches run in
parallel off one shared LayerNorm, a plain `nn.Linear` input projection (unmarked: replicated),
one MoE block, and a final norm before the output layer. Trained through `forward_backward`
and our gradient finalization and clipping; no megatron_lite Config anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.moe import MoELayer
from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.parallel.data_parallel import clip_grads, finalize_grads, local_grad_square_sum
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
from megatron_lite.parallel.norms import LayerNorm
from megatron_lite.parallel.params import init_parameters
from megatron_lite.pipeline import forward_backward, virtual_stage
from tests.parallel.parity import Curve

VOCAB, HIDDEN, HEADS, FFN, SEQ, LAYERS, EXPERTS = 96, 32, 4, 64, 16, 4, 4
MOE_BLOCK = 2  # the third block is a mixture of experts
GLOBAL_BATCH, STEPS = 8, 10
# AdamW's first steps move each weight by ~lr·sign(g): with eps far below the gradients, fp32
# rounding noise in near-zero gradient components becomes O(lr) weight differences between
# layouts that grow step by step (and another CPU's rounding amplifies differently); a larger
# eps makes the update continuous in g there (README "Tests")
LR, ADAM_EPS = 1e-2, 1e-6


class ParallelBlock(nn.Module):
    """x + attn(ln(x)) + mlp(ln(x)) on [s(/tp), b, h] (GPT-J's parallel residual)."""

    def __init__(self, mesh: ParallelMesh, sp: bool, moe: bool, block: int, moe_scale: float):
        super().__init__()
        tp = mesh.tp.group
        self.heads = HEADS // mesh.tp.size
        self.ln = LayerNorm(HIDDEN, sequence_parallel=sp)
        self.qkv = ColumnParallelLinear(HIDDEN, [HIDDEN] * 3, tp, bias=False, sequence_parallel=sp)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, tp, bias=False, sequence_parallel=sp)
        if moe:
            self.mlp = MoELayer(
                HIDDEN, FFN, EXPERTS, 2,
                ep_group=mesh.ep.group, token_groups=[tp], sequence_parallel=sp, gated=False,
                aux_loss_coeff=1e-2, aux_loss_scale=moe_scale, layer_number=block,
            )  # fmt: skip
        else:
            self.mlp = nn.Sequential(
                ColumnParallelLinear(HIDDEN, FFN, tp, sequence_parallel=sp),
                nn.GELU(),
                RowParallelLinear(FFN, HIDDEN, tp, sequence_parallel=sp),
            )

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [s, b, h/tp] each
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, self.heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n/tp, s, d]
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln(x)
        return x + self.attention(normed) + self.mlp(normed)


class Chunk(nn.Module):
    """The blocks of one virtual pipeline stage; the first embeds, the last returns the loss."""

    def __init__(self, mesh, sp, blocks, first, last, moe_scale):
        super().__init__()
        self.mesh, self.sp, self.first, self.last = mesh, sp, first, last
        tp = mesh.tp.group
        if first:
            self.embedding = VocabParallelEmbedding(VOCAB, VOCAB, HIDDEN, tp)
            self.proj_in = nn.Linear(HIDDEN, HIDDEN)  # a plain torch layer: replicated
        self.blocks = nn.ModuleDict(
            {str(i): ParallelBlock(mesh, sp, i == MOE_BLOCK, i, moe_scale) for i in blocks}
        )
        if last:
            self.final_ln = LayerNorm(HIDDEN, sequence_parallel=sp)
            self.output = ColumnParallelLinear(HIDDEN, VOCAB, tp, bias=False, sequence_parallel=sp)

    def forward(self, x, labels):
        tp = self.mesh.tp.group
        if self.first:  # ids [b, s] -> [s(/tp), b, h]
            x = mappings.reduce_from_tensor_parallel_region(self.embedding(x.t()), tp)
            x = self.proj_in(x)  # on the full sequence, identical on every TP rank
            if self.sp:
                x = mappings.scatter_to_sequence_parallel_region(x, tp)
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.output(self.final_ln(x))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels.t(), tp).sum()


def global_batch(step: int) -> torch.Tensor:
    """The same [G, s + 1] token ids on every layout (a structured, learnable sequence)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def train(rank: int, world: int, tp: int, pp: int, vpp: int, ep: int) -> Curve | None:
    """Losses and gradient norms of STEPS steps on this layout (rank 0 returns them)."""
    torch.manual_seed(0)
    mesh = ParallelMesh(RankLayout(world, tp=tp, pp=pp, ep=ep))
    sp = tp > 1
    dp, mb = mesh.dp.size, 1
    n_micro = GLOBAL_BATCH // (dp * mb)
    moe_scale = 1.0 / (n_micro * dp)  # the aux term's gradient per microbatch, one MoE layer
    per_stage = LAYERS // (pp * vpp)
    chunks = []
    for c in range(vpp):
        stage = virtual_stage(mesh.pp.rank, c, pp)
        blocks = range(stage * per_stage, (stage + 1) * per_stage)
        chunk = Chunk(mesh, sp, blocks, stage == 0, stage == pp * vpp - 1, moe_scale)
        init_parameters(chunk, seed=7)
        chunks.append(chunk)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS, weight_decay=0.0, foreach=False)

    def forward_step(chunk, sample, x):
        tokens, labels = sample[:, :-1], sample[:, 1:]
        return chunk(tokens if x is None else x, labels)

    losses, norms = [], []
    for step in range(STEPS):
        mine = global_batch(step).chunk(dp)[mesh.dp.rank]
        total = forward_backward(
            chunks,
            list(mine.split(mb)),
            forward_step,
            pp_group=mesh.pp.group,
            tensor_shape=(SEQ // (tp if sp else 1), mb, HIDDEN),
            loss_scale=1.0 / (GLOBAL_BATCH * SEQ),
        )
        finalize_grads(params, mesh, tie_embeddings=False, embedding_param=None)
        grad_sq = local_grad_square_sum(params, mesh)
        dist.all_reduce(grad_sq)  # summed over the world it counts every element once
        norms.append(grad_sq.item() ** 0.5)
        clip_grads(params, norms[-1], max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the last stage's TP ranks all hold the loss: count tp rank 0's
        owner = mesh.is_last_stage and mesh.tp.rank == 0
        loss = torch.tensor([total.item() if owner else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(loss.item() / (GLOBAL_BATCH * SEQ))
    return Curve(losses, norms) if rank == 0 else None
