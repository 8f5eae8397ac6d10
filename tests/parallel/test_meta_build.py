"""A model built for a checkpoint to fill (init=False) is built on the meta device and given
uninitialized storage: nothing is drawn, every Parameter keeps its sharding metadata, and the
non-persistent buffers (RoPE tables, vocabulary padding mask) equal an eager build's; drawing
its weights afterwards gives exactly the eagerly initialized model."""

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY


def _compare(rank, world, overrides):
    import torch

    import megatron_lite.models as models
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.params import init_parameters
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare

    cfg, _, vocab = prepare(["data.mock=true", *TINY, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
    eager = models.build_model(cfg, mesh, tracker, vocab)
    drawn = []
    real_init = models.init_parameters
    models.init_parameters = lambda *a: drawn.append(a)
    try:
        lazy = models.build_model(cfg, mesh, tracker, vocab, init=False)
    finally:
        models.init_parameters = real_init
    assert not drawn, "init=False drew weights"
    for e, z in zip(eager, lazy, strict=True):
        for (name, a), (_, b) in zip(e.named_parameters(), z.named_parameters(), strict=True):
            assert not b.is_meta and b.device == a.device and b.shape == a.shape, name
            assert b.meta == a.meta, name
        for (name, a), (_, b) in zip(e.named_buffers(), z.named_buffers(), strict=True):
            assert torch.equal(a, b), name
        init_parameters(z, cfg.train.seed)
        for (name, a), (_, b) in zip(e.named_parameters(), z.named_parameters(), strict=True):
            assert torch.equal(a, b), name
    return len(list(lazy[0].named_buffers()))


def test_meta_build_matches_the_eager_one():
    # tp2 with a padded vocabulary (250 -> 256 with divisible_by 8·2) on the last stage
    assert run_ranks(2, _compare, ["parallel.tp=2"], timeout=60)[0] == 3
    assert run_ranks(2, _compare, ["parallel.pp=2", "model.arch=gpt"], timeout=60)[1] == 1
