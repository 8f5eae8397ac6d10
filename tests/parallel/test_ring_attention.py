"""Ring attention (context/ring.py) against a float64 reference with an explicit mask: output
and gradients, causal load balance (counted work per rank) and the bytes it sends."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks


def _reference(q, k, v, docs):
    """Plain float64 attention over the whole sequence: causal, and within a document."""
    s, n, g = q.shape[0], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(n // g, dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)


def _ring_vs_reference(rank, world, n, g, with_docs, balanced, tile=None):
    from megatron_lite.context import ring
    from megatron_lite.context.layout import positions, ring_ranges
    from megatron_lite.parallel.comm_stats import STATS

    torch.manual_seed(0)
    s, b, d = 16, 2, 4
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (n, g, g))
    gout = torch.randn(s, b, n, d, dtype=torch.float64)
    docs = None
    if with_docs:  # documents of 1..7 tokens, different in each row
        docs = torch.cumsum((torch.rand(b, s) < 0.3).long(), dim=1)
    all_ranges = ring_ranges(s, world, balanced)
    mine = positions(all_ranges[rank])
    work = []
    real = ring.block_forward

    def counted(q_, k_, v_, mask, scale):
        work.append(q_.shape[-2] * k_.shape[-2])
        return real(q_, k_, v_, mask, scale)

    ring.block_forward = counted
    shard = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    STATS.start_step(0)
    kw = {} if tile is None else {"tile": tile}
    out = ring.ring_attention(*shard, dist.group.WORLD, all_ranges, docs, **kw)
    fwd_bytes = STATS.bytes["cp_send"]
    out.backward(gout[mine])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, docs)
    ref.backward(gout)
    errs = [float((out - ref[mine]).abs().max())]
    errs += [float((a.grad - r.grad[mine]).abs().max()) for a, r in zip(shard, full, strict=True)]
    return max(errs), sum(work), fwd_bytes, STATS.bytes["cp_send"], STATS.bytes["cp_recv"]


@pytest.mark.parametrize(
    "world,n,g,docs,tile",
    [(2, 4, 4, False, None), (4, 4, 2, False, None), (4, 4, 1, True, None),
     (2, 2, 2, True, 3)],
    ids=["cp2_mha", "cp4_gqa", "cp4_mqa_docs", "cp2_docs_tiles_of_3"],
)  # fmt: skip
def test_ring_matches_float64_reference(world, n, g, docs, tile):
    s, b, d = 16, 2, 4
    results = run_ranks(world, _ring_vs_reference, n, g, docs, True, tile, timeout=60)
    block = s // world * b * 2 * g * d * 8  # one K/V block, float64
    for rank, (err, _, fwd, total, recv) in enumerate(results):
        assert err < 1e-10, f"rank {rank}: ring attention vs float64 reference: {err:.2e}"
        assert fwd == (world - 1) * block, f"rank {rank}: forward sent {fwd}, not R-1 blocks"
        # backward: the K/V blocks again and each block's dK/dV (R)
        assert total == (3 * world - 2) * block, f"rank {rank}: sent {total} bytes in all"
        assert recv == total
    work = [w for _, w, *_ in results]
    chunk = s // (2 * world)
    if not docs:  # causal balance: every rank computes 2R+1 chunk² sub-blocks
        assert max(work) / (sum(work) / world) <= 1.05, f"attention work per rank: {work}"
        assert work == [(2 * world + 1) * chunk**2] * world, work
    else:  # sub-blocks whose rows share no document are skipped
        assert sum(work) < world * (2 * world + 1) * chunk**2, work


def test_naive_split_is_unbalanced_and_still_exact():
    results = run_ranks(4, _ring_vs_reference, 4, 2, False, False, timeout=60)
    assert max(err for err, *_ in results) < 1e-10
    work = [w for _, w, *_ in results]
    # contiguous quarters: rank r attends to r + 1 quarters (the last does 4 of the 10)
    assert work == sorted(work) and max(work) / (sum(work) / 4) > 1.5, work
