"""Another model that is not ours, trained through the public data-parallel wrapper: a small
bidirectional (non-causal) encoder with learned position embeddings and a masked-token
objective, built only from megatron_lite's public building blocks; no megatron_lite Config.

The learned positions are a plain parameter added to each rank's sequence shard, so under
sequence parallelism every TP rank holds the gradient of its own rows only: it is marked
`sequence_parallel` and the wrapper sums it over TP. The blocks live in `blocks` (not our
`layers`), so ZeRO-3 gets them through `layers_of`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from megatron_lite.parallel.data_parallel import (
    DataParallelOptimizer,
    DataParallelWrapper,
    build_data_parallel,
)
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
from megatron_lite.parallel.norms import LayerNorm
from megatron_lite.parallel.params import init_parameters, set_meta
from megatron_lite.pipeline import forward_backward

VOCAB, HIDDEN, HEADS, FFN, SEQ, LAYERS = 64, 32, 4, 64, 16, 2
MASK = VOCAB - 1  # the mask token; sequences run mod MASK, so it is never a real token
MASKED_PER_SAMPLE, GLOBAL_BATCH, MICRO, STEPS = 4, 8, 2, 10
# AdamW's first steps are sign(g)·lr: a modest lr and an eps well above rounding noise in the
# gradients keep that noise from being amplified into full-size update flips
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-3, (0.9, 0.95), 1e-6, 0.1, 1.0


class EncoderBlock(nn.Module):
    """Pre-norm x + attn(ln(x)), then x + mlp(ln(x)), on [s(/tp), b, h]; attention sees the
    whole sequence both ways."""

    def __init__(self, mesh: ParallelMesh, sp: bool):
        super().__init__()
        tp = mesh.tp.group
        self.heads = HEADS // mesh.tp.size
        self.ln_attn = LayerNorm(HIDDEN, sequence_parallel=sp)
        self.qkv = ColumnParallelLinear(HIDDEN, [HIDDEN] * 3, tp, sequence_parallel=sp)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, tp, sequence_parallel=sp)
        self.ln_mlp = LayerNorm(HIDDEN, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, tp, sequence_parallel=sp)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [s, b, h/tp] each (SP: gathered sequence)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, self.heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False)  # [b, n/tp, s, d]
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))  # [s(/tp), b, h]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attn(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_mlp(x))))


class Encoder(nn.Module):
    """Token + learned position embeddings, LAYERS blocks, final norm, vocabulary head; the
    forward returns the summed cross-entropy over the masked positions."""

    def __init__(self, mesh: ParallelMesh):
        super().__init__()
        self.mesh, self.sp = mesh, mesh.tp.size > 1
        tp = mesh.tp.group
        self.embedding = VocabParallelEmbedding(VOCAB, VOCAB, HIDDEN, tp)
        self.positions = nn.Parameter(torch.empty(SEQ, HIDDEN))
        set_meta(self.positions, full_shape=(SEQ, HIDDEN), sequence_parallel=self.sp)
        self.blocks = nn.ModuleList(EncoderBlock(mesh, self.sp) for _ in range(LAYERS))
        self.final_ln = LayerNorm(HIDDEN, sequence_parallel=self.sp)
        self.head = ColumnParallelLinear(HIDDEN, VOCAB, tp, bias=False, sequence_parallel=self.sp)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tp = self.mesh.tp.group
        x = mappings.reduce_from_tensor_parallel_region(self.embedding(ids.t()), tp)  # [s, b, h]
        pos = self.positions  # [s, h]
        if self.sp:
            x = mappings.scatter_to_sequence_parallel_region(x, tp)  # [s/tp, b, h]
            pos = pos.chunk(self.mesh.tp.size)[self.mesh.tp.rank]  # this shard's rows
        x = x + pos[:, None, :]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_ln(x))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels.t(), tp).sum()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The one (inputs, labels) [G, s] of every step and layout: arithmetic progressions mod
    MASK with MASKED_PER_SAMPLE positions per sample replaced by MASK; labels only there."""
    g = torch.Generator().manual_seed(2000)
    start = torch.randint(0, MASK, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ)) % MASK
    where = torch.stack([torch.randperm(SEQ, generator=g)[:MASKED_PER_SAMPLE] for _ in tokens])
    masked = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, where, True)
    return tokens.masked_fill(masked, MASK), tokens.masked_fill(~masked, IGNORE_INDEX)


def _setup(world: int, tp: int) -> tuple[ParallelMesh, Encoder]:
    torch.manual_seed(0)
    mesh = ParallelMesh(RankLayout(world, tp=tp))
    model = Encoder(mesh)
    init_parameters(model, seed=11)  # the same full weights on every layout
    return mesh, model


def _loss_sum(mesh: ParallelMesh, model: Encoder, before_backward=None) -> torch.Tensor:
    """Forward and backward of this rank's samples of the batch (microbatches of MICRO);
    returns the summed loss of this rank's masked tokens."""
    inputs, labels = (t.chunk(mesh.dp.size)[mesh.dp.rank] for t in global_batch())
    return forward_backward(
        [model],
        list(zip(inputs.split(MICRO), labels.split(MICRO), strict=True)),
        lambda chunk, mb, _input: chunk(*mb),
        loss_scale=1.0 / (GLOBAL_BATCH * MASKED_PER_SAMPLE),  # the global masked-token mean
        before_backward=before_backward,  # ZeRO-3 then reduces in the last microbatch only
    )


def _global_loss(mesh: ParallelMesh, total: torch.Tensor) -> float:
    """The step's mean loss: every TP rank holds its dp rank's sum, tp rank 0 reports it."""
    loss = torch.tensor([total.item() if mesh.tp.rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    return loss.item() / (GLOBAL_BATCH * MASKED_PER_SAMPLE)


def reference(rank: int, world: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per step on one rank with plain torch AdamW (decay on matrices) and
    the clipping written out: the independent reference of every layout."""
    mesh, model = _setup(world, tp=1)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    out = []
    for _ in range(STEPS):
        loss = _global_loss(mesh, _loss_sum(mesh, model))
        norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params]
        norm = torch.linalg.vector_norm(torch.stack(norms)).item()
        if norm > MAX_NORM:
            for p in params:
                p.grad.mul_(MAX_NORM / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss, norm))
    return out


def train(rank: int, world: int, tp: int, zero_stage: int) -> list[tuple[float, float]] | None:
    """(loss, grad norm) per step through `build_data_parallel` (rank 0 returns them)."""
    mesh, model = _setup(world, tp)
    dp = build_data_parallel(
        [model], mesh, zero_stage=zero_stage, lr=LR, betas=BETAS, eps=EPS,
        weight_decay=WEIGHT_DECAY, bucket_size=2000,  # several buckets (stages 0-2)
        layers_of=lambda chunk: chunk.blocks,  # ZeRO-3's units: not our `layers`
    )  # fmt: skip
    assert isinstance(dp, DataParallelWrapper) and isinstance(dp.optimizer, DataParallelOptimizer)
    out = [dp_step(mesh, model, dp) for _ in range(STEPS)]
    return out if rank == 0 else None


def dp_step(mesh: ParallelMesh, model: Encoder, dp) -> tuple[float, float]:
    """One optimizer step of `model` through its DataParallelWrapper `dp` on the global batch:
    (loss, gradient norm before clipping to MAX_NORM)."""
    dp.start_step(GLOBAL_BATCH // (mesh.dp.size * MICRO))
    total = _loss_sum(mesh, model, dp.before_backward)
    dp.finish_grad_sync()
    grad_sq = dp.grad_square_sum()
    dist.all_reduce(grad_sq)  # summed over the world it counts every element once
    norm = grad_sq.item() ** 0.5
    dp.clip(norm, MAX_NORM)
    dp.step()
    return _global_loss(mesh, total), norm
