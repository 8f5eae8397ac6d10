"""Validation loss: the same on every layout (token-weighted over the global eval batch), and
evaluating never changes training (samples, RNG, losses)."""

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, max_rel_diff, structured_dataset

SPLIT = ['data.split="90,10,0"', "train.eval_iters=2", "train.steps=6"]


def _train(rank, world, overrides, out_dir):
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep))
    records = Trainer(cfg, mesh, dataset, vocab).train()
    if dist.get_rank() != 0:
        return None
    return [r["loss"] for r in records], {
        r["step"]: r["eval_loss"] for r in records if "eval_loss" in r
    }


def _run(world, overrides, tmp):
    args = [*TINY, f"data.paths=[{structured_dataset()}]", *SPLIT, *overrides]
    return run_ranks(world, _train, args, tmp, timeout=180)[0]


def test_eval_loss_is_layout_independent_and_leaves_training_alone(tmp_path):
    plain, no_eval = _run(1, ["train.eval_interval=0"], str(tmp_path / "plain"))
    losses, evals = _run(1, ["train.eval_interval=3"], str(tmp_path / "ref"))
    assert not no_eval and losses == plain  # bitwise: evaluation changes nothing in training
    assert sorted(evals) == [2, 5] and evals[5] < evals[2], evals
    layouts = {
        "tp2_sp_pp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]),
        "dp2_zero1": (2, ["parallel.zero_stage=1"]),
        # zero-bubble training, evaluation on the unchanged forward-only table
        "pp2_zb_h1": (2, ["parallel.pp=2", "parallel.pipeline_schedule=zb-h1"]),
        # the V placement's forward-only table: the turn on rank 1, the loss on rank 0
        "pp2_zb_v": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zb-v"]),
    }
    for name, (world, over) in layouts.items():
        got_losses, got_evals = _run(world, ["train.eval_interval=3", *over], str(tmp_path / name))
        diff = max_rel_diff(
            [got_evals[s] for s in sorted(got_evals)], [evals[s] for s in sorted(evals)]
        )
        print(f"EVAL {name}: max rel diff of the eval loss {diff:.2e}")
        assert diff < 1e-5, f"{name}: eval loss differs by {diff:.2e}: {got_evals} vs {evals}"
        assert max_rel_diff(got_losses, losses) < 1e-5, name
