"""The non-finite guard covers state the step updates outside the optimizer: a NaN/Inf expert
bias (no gradient, so the loss and the gradient norm stay finite) stops the run on every rank,
naming the step, the tensor, the rank and the key, before the step's checkpoint is written;
and any module can declare such state (`step_updated_state()`) without changing the guard."""

import os

import torch
from torch import nn

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

MOE = [
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true",
    "parallel.ep=2",
]


def _train(rank, world, overrides, out_dir, poison_step):
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.nonfinite import NonFiniteError
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    routers = [m for c in trainer.chunks for m in c.modules() if hasattr(m, "expert_bias")]
    if rank == world - 1:  # one rank's bias update overflows at step `poison_step` (1-based)
        router, update = routers[-1], routers[-1].update_expert_bias

        def overflowing(counts):
            update(counts)
            if trainer.step + 1 == poison_step:
                router.expert_bias.data[1] = float("inf")

        router.update_expert_bias = overflowing
    try:
        trainer.train()
    except NonFiniteError as e:
        return "stopped", str(e), trainer.step
    finally:
        trainer.checkpointer.finish()
    return "done", None, trainer.step


def test_nonfinite_expert_bias_stops_every_rank_before_its_checkpoint(tmp_path):
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, *MOE, "train.steps=4", "train.save_interval=1"]
    results = run_ranks(2, _train, args, str(tmp_path), 2, timeout=180)
    for rank, (status, message, step) in enumerate(results):
        assert status == "stopped" and step == 1, f"rank {rank}: {status} {message}"
        assert message.startswith("step 2: non-finite state updated outside the optimizer in ")
        assert ".mlp.router.expert_bias on rank 1" in message, message
        assert "model.moe_router_bias_update_rate" in message and "Fix:" in message, message
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    assert [s for s in saved if s.startswith("step_")] == ["step_1"], saved


class _Counter(nn.Module):
    """A module with state of its own that the step moves (as the router's expert bias)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def step_updated_state(self):
        return [("total", self.total, "test.counter_rate")]


def test_any_module_can_declare_step_updated_state():
    from megatron_lite.training.nonfinite import step_updated_state

    chunks = [nn.Sequential(nn.Linear(2, 2), _Counter()), nn.ModuleDict({"a": _Counter()})]
    found = [(name, key) for name, _, key in step_updated_state(chunks)]
    assert found == [("1.total", "test.counter_rate"), ("a.total", "test.counter_rate")], found
    assert step_updated_state([nn.Linear(2, 2)]) == []
