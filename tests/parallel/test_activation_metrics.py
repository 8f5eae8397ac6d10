"""mem/activations_peak is the max over ranks of each rank's step peak, every step, also when
the peaks move (MoE with ep2: each rank receives a different token count each step)."""

from tests.dist_harness import run_ranks

MOE = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=32",
       "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=16",
       "model.num_experts=4", "model.moe_router_topk=2", "parallel.ep=2",
       "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=3",
       "data.mock=true", "log.progress=false"]  # fmt: skip


def _steps(rank, world, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *MOE], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world, ep=2)), dataset, vocab)
    out = []
    for _ in range(cfg.train.steps):
        record = trainer.train_step()
        out.append((trainer.last_activation_report["peak_bytes"], record["mem/activations_peak"]))
    return out


def test_activation_peak_is_the_max_over_ranks_every_step(tmp_path):
    ranks = run_ranks(2, _steps, str(tmp_path), timeout=60)
    local = [[peak for peak, _ in steps] for steps in ranks]
    for step, reported in enumerate(r for _, r in ranks[0]):
        want = max(local[0][step], local[1][step])
        assert reported == want == ranks[1][step][1], (step, local, reported)
    assert len(set(local[0] + local[1])) > 1, f"the peaks never moved: {local}"
