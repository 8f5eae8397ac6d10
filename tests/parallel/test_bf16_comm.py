"""bf16 training moves bf16: with train.precision=bf16 the residual stream is bf16, so the TP
all-gathers and reduce-scatters and the pipeline P2P carry 2-byte elements, exactly half the
bytes of the same fp32 run. With model.fp32_residual_connection=true the stream (and so the
P2P and the input-gradient reduce-scatters) is fp32 again while the column-parallel gathers
(cast to bf16 first) and the row-parallel GEMM outputs stay bf16. The losses follow each
other to bf16 rounding. Bytes are the last step's, summed over the ranks of both stages."""

import collections
import functools
import tempfile

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

LAYOUT = [
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
    "parallel.pp=2",
    "train.steps=3",
]


def _train(rank, world, overrides, out_dir):
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    from megatron_lite.parallel.comm_stats import STATS

    records = Trainer(cfg, mesh, dataset, vocab).train()
    losses = [r["loss"] for r in records] if dist.get_rank() == 0 else None
    return losses, dict(STATS.bytes)  # this rank's bytes per kind in the last step


@functools.cache
def run(precision: str, fp32_residual: bool) -> tuple[list[float], dict[str, int]]:
    """Rank 0's losses and the last step's bytes per kind summed over the 4 ranks."""
    data = f"data.paths=[{structured_dataset()}]"
    flags = [f"train.precision={precision}", f"model.fp32_residual_connection={fp32_residual}"]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(4, _train, [*TINY, data, *LAYOUT, *flags], tmp, timeout=120)
    total = collections.Counter()
    for _, stats in ranks:
        total.update(stats)
    return ranks[0][0], dict(total)


TP_KINDS = ("all_gather", "reduce_scatter")
P2P_KINDS = ("p2p_send", "p2p_recv")


def _bytes(result, kind):
    return result[1][kind]


def test_bf16_stream_halves_tp_and_p2p_bytes():
    bf16, fp32 = run("bf16", False), run("fp32", False)
    for kind in TP_KINDS + P2P_KINDS:
        assert 2 * _bytes(bf16, kind) == _bytes(fp32, kind), (kind, bf16[1], fp32[1])


def test_fp32_residual_connection_moves_fp32_stream():
    bf16, res32, fp32 = run("bf16", False), run("bf16", True), run("fp32", False)
    for kind in P2P_KINDS:  # the stage boundary carries the stream: fp32 again
        assert _bytes(res32, kind) == _bytes(fp32, kind) == 2 * _bytes(bf16, kind), kind
    # column-parallel inputs are cast to bf16 before their gather (linear_async: the same values);
    # input-gradient reduce-scatters follow the fp32 stream, row-parallel GEMM outputs stay bf16
    assert _bytes(bf16, "all_gather") == _bytes(res32, "all_gather") < _bytes(fp32, "all_gather")
    kind = "reduce_scatter"
    assert _bytes(bf16, kind) < _bytes(res32, kind) < _bytes(fp32, kind), kind
    for a, b in zip(bf16[0], res32[0], strict=True):
        assert abs(a - b) / abs(b) < 5e-3, (bf16[0], res32[0])
