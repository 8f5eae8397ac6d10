"""Tensor-parallel layers (with and without sequence parallelism) against plain float64 torch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_harness import run_ranks

S, B, H, FFN, V = 8, 2, 12, 16, 37


def _full_tensors():
    torch.manual_seed(0)
    return {
        "x": torch.randn(S, B, H, dtype=torch.float64),
        "w1": torch.randn(FFN, H, dtype=torch.float64),
        "b1": torch.randn(FFN, dtype=torch.float64),
        "w2": torch.randn(H, FFN, dtype=torch.float64),
        "b2": torch.randn(H, dtype=torch.float64),
        "emb": torch.randn(V, H, dtype=torch.float64),
        "ids": torch.randint(0, V, (S, B)),
        "gout": torch.randn(S, B, H, dtype=torch.float64),
    }


def _reference(t):
    x = t["x"].clone().requires_grad_()
    w1, b1, w2, b2 = (t[k].clone().requires_grad_() for k in ("w1", "b1", "w2", "b2"))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(t["gout"])
    return y.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad


def _mlp_on_ranks(rank, world, sp):
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_lite.parallel.params import shard

    g = dist.group.WORLD
    t = _full_tensors()
    fc1 = ColumnParallelLinear(H, FFN, g, sequence_parallel=sp).double()
    fc2 = RowParallelLinear(FFN, H, g, sequence_parallel=sp).double()
    with torch.no_grad():
        fc1.weight.copy_(shard(t["w1"], fc1.weight.meta))
        fc1.bias.copy_(shard(t["b1"], fc1.bias.meta))
        fc2.weight.copy_(shard(t["w2"], fc2.weight.meta))
        fc2.bias.copy_(t["b2"])
    x = (t["x"].chunk(world)[rank] if sp else t["x"]).clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    gout = t["gout"].chunk(world)[rank] if sp else t["gout"]
    y.backward(gout)
    ry, rgx, rw1, rb1, rw2, rb2 = _reference(t)
    if sp:  # bias grad from a sequence shard: finalization sums it over TP
        dist.all_reduce(fc2.bias.grad)
        ry, rgx = ry.chunk(world)[rank], rgx.chunk(world)[rank]
    pairs = {
        "y": (y, ry),
        "dx": (x.grad, rgx),
        "dw1": (fc1.weight.grad, shard(rw1, fc1.weight.meta)),
        "db1": (fc1.bias.grad, shard(rb1, fc1.bias.meta)),
        "dw2": (fc2.weight.grad, shard(rw2, fc2.weight.meta)),
        "db2": (fc2.bias.grad, rb2),
    }
    return {k: float((a - b).abs().max()) for k, (a, b) in pairs.items()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_column_row_mlp_matches_float64_reference(sp):
    for rank, errs in enumerate(run_ranks(2, _mlp_on_ranks, sp, timeout=60)):
        for k, e in errs.items():
            assert e < 1e-10, f"rank {rank} {k}: max abs error {e}"


def _embedding_and_loss(rank, world):
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_lite.parallel.layers import VocabParallelEmbedding
    from megatron_lite.parallel.mappings import (
        copy_to_tensor_parallel_region,
        reduce_from_tensor_parallel_region,
    )
    from megatron_lite.parallel.params import shard

    g = dist.group.WORLD
    t = _full_tensors()
    padded = 40  # V=37 padded to a multiple of 2·(divisible 4): padding never changes the loss
    emb = VocabParallelEmbedding(V, padded, H, g).double()
    with torch.no_grad():
        emb.weight.copy_(shard(t["emb"], emb.weight.meta))
    x = reduce_from_tensor_parallel_region(emb(t["ids"]), g)  # [s, b, h]
    # logits against the (tied) embedding, padded columns masked as the model does
    # the output layer is column-parallel: its input grad is a partial sum over TP
    logits = copy_to_tensor_parallel_region(x, g) @ emb.weight.t()  # [s, b, V_pad/tp]
    cols = torch.arange(padded // world) + rank * padded // world
    logits = logits.masked_fill(cols >= V, float("-inf"))
    labels = torch.roll(t["ids"], 1, 0)
    loss = vocab_parallel_cross_entropy(logits, labels, g)
    loss.sum().backward()
    ref_w = t["emb"].clone().requires_grad_()
    rx = F.embedding(t["ids"], ref_w)
    rloss = F.cross_entropy(
        (rx @ ref_w.t()).reshape(S * B, V), labels.reshape(-1), reduction="none"
    ).view(S, B)
    rloss.sum().backward()
    return {
        "x": float((x - rx).abs().max()),
        "loss": float((loss - rloss).abs().max()),
        "dw": float((emb.weight.grad - shard(ref_w.grad, emb.weight.meta)).abs().max()),
    }


def test_vocab_parallel_embedding_and_cross_entropy():
    for rank, errs in enumerate(run_ranks(2, _embedding_and_loss, timeout=60)):
        for k, e in errs.items():
            assert e < 1e-9, f"rank {rank} {k}: max abs error {e}"
