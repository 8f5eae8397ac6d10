"""ZeRO-3 from scratch builds on the meta device, shards there and draws only each rank's
shards: the sharded weights are exactly the eagerly built model's (uneven and empty shards,
vocabulary padding, parameters a module's reset_parameters draws), and the memory of building
the trainer falls as 1/N with the data-parallel size."""

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY


def _plain_model():
    """Plain torch modules (no metadata: drawn by their reset_parameters); the [2, 5] weight
    over 3 ranks leaves one rank without rows."""
    from torch import nn

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(5, 2), "1": nn.LayerNorm(5)})
    model.head = nn.Linear(5, 7)
    return model


def _check_sharded(name, sharded, eager) -> None:
    """`sharded` (a DTensor) holds rows fsdp_rows of `eager`, and gathers to all of it."""
    import torch

    from megatron_lite.parallel.params import fsdp_rows

    start, end = fsdp_rows(sharded)
    assert torch.equal(sharded.to_local(), eager[start:end]), f"{name}: rows {start}..{end}"
    assert torch.equal(sharded.full_tensor(), eager), f"{name}: gathered weight differs"


def _compare(rank, world):
    import torch

    import megatron_lite.models as models
    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.params import init_parameters
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare

    args = ["data.mock=true", "model.arch=llama", *TINY, "train.global_batch_size=6"]
    cfg, _, vocab = prepare(args, world_size=world)
    mesh = ParallelMesh(RankLayout(world))
    tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
    (eager,) = models.build_model(cfg, mesh, tracker, vocab)
    (lazy,) = models.build_model(cfg, mesh, tracker, vocab, init=False, device="meta")
    torch.manual_seed(rank)  # the draw must not depend on the global generator
    plain_eager, plain = _plain_model(), None
    init_parameters(plain_eager, cfg.train.seed)
    with torch.device("meta"):
        plain = _plain_model()
    for model in (lazy, plain):
        build_data_parallel([model], mesh, zero_stage=3, device="cpu")
        init_parameters(model, cfg.train.seed)
    lazy.init_buffers(torch.device("cpu"))
    for name, a in eager.named_buffers():
        assert torch.equal(a, lazy.get_buffer(name)), name
    pairs = [*zip(eager.named_parameters(), lazy.parameters(), strict=True)]
    pairs += zip(plain_eager.named_parameters(), plain.parameters(), strict=True)
    for (name, a), b in pairs:
        _check_sharded(name, b, a)
    return [p.to_local().shape[0] for p in plain.parameters()]


def test_zero3_from_scratch_draws_the_eager_weights():
    # dp3: uneven shards (64 -> 22, 22, 20 rows); the padded vocabulary's zero rows (250 -> 256)
    # on the last rank; row-parallel weights split along TP's dim 1 and FSDP2's dim 0
    rows = run_ranks(3, _compare, timeout=90)
    assert [r[0] for r in rows] == [1, 1, 0], f"layers.0.weight rows per rank: {rows}"


# ~8.0M parameters (32 MB in fp32): far above the few generator blocks (2^16 values each) that
# initialization holds for a moment
MODEL = [*TINY, "model.arch=llama", "model.hidden_size=256", "model.ffn_hidden_size=1024",
         "model.num_layers=8", "data.mock=true", "parallel.zero_stage=3"]  # fmt: skip


def _init_peak(rank, world, out_dir):
    """Peak bytes of CPU tensor storage alive at once while this rank builds its Trainer."""
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer
    from tests.parallel.live_bytes import LiveBytes

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}/{world}", *MODEL], world_size=world)
    with LiveBytes() as meter:
        trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    return meter.peak, trainer.num_parameters()


def test_zero3_init_memory_falls_as_one_over_n(tmp_path):
    """Each rank's peak during the trainer's init is the dp=1 peak over N, plus a little: at
    most 0.55x on dp=2 and 0.3x on dp=4 (1/N plus 5 points for the moment's generator blocks,
    FSDP2's padded copy of a shard and the small buffers; the old code built the whole model on
    every rank before sharding it: >= 1x)."""
    peaks = {n: run_ranks(n, _init_peak, str(tmp_path), timeout=90) for n in (1, 2, 4)}
    (one, params), = peaks[1]  # fmt: skip
    assert params > 7_000_000, f"{params} parameters: the model is too small to measure"
    for n, bound in ((2, 0.55), (4, 0.3)):
        ratios = [peak / one for peak, _ in peaks[n]]
        print(f"INIT MEMORY dp{n}: {[p for p, _ in peaks[n]]} bytes vs dp1 {one}: {ratios}")
        assert max(ratios) <= bound, f"dp{n}: init peak {max(ratios):.2f}x dp1's, over {bound}"


def _refusals(rank, world):
    import pytest
    import torch

    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout

    mesh = ParallelMesh(RankLayout(world))
    with torch.device("meta"):
        model = _plain_model()
    with pytest.raises(ValueError, match="zero_stage=1 with chunks on the meta device"):
        build_data_parallel([model], mesh, zero_stage=1)
    with pytest.raises(ValueError, match="no device= was given"):
        build_data_parallel([model], mesh, zero_stage=3)
    model.head.to_empty(device="cpu")
    with pytest.raises(ValueError, match="some parameters are on the meta device"):
        build_data_parallel([model], mesh, zero_stage=3, device="cpu")


def test_meta_chunks_are_refused_where_they_cannot_work():
    run_ranks(1, _refusals, timeout=30)
