"""What ZeRO-3 relies on in torch's FSDP2, pinned on CPU: the start-up check passes on this
torch and names what changed when a relied-on attribute is gone or a signature changed (in
config validation, before any process group); the gradient-accumulation flags are set by the
pipeline engine before each backward, outside autograd, from the schedule (not from a hook in
the middle of the backward); fused AdamW steps FSDP2's DTensor parameters as the per-tensor
path does."""

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from megatron_lite.config import ConfigError
from megatron_lite.parallel.data_parallel.fsdp_compat import SUPPORTED, FSDP2APIError, check_fsdp2
from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


def test_this_torch_has_everything_zero3_uses():
    assert check_fsdp2() == [], "optional FSDP2 API absent on the verified torch"


def _error(match: str) -> str:
    with pytest.raises(FSDP2APIError) as e:
        check_fsdp2()
    msg = str(e.value)
    assert match in msg and SUPPORTED in msg and "Fix:" in msg, msg
    return msg


def test_a_missing_setter_is_named_with_its_user(monkeypatch):
    monkeypatch.delattr(FSDPModule, "set_is_last_backward")
    _error(
        "torch.distributed.fsdp.FSDPModule.set_is_last_backward is missing "
        "(used by fsdp.py (gradient accumulation))"
    )


def test_an_override_whose_signature_changed_is_named(monkeypatch):
    """FSDP2 calls our collective overrides by keyword: a new parameter breaks them."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    def changed(self, output_tensor, input_tensor, group, op, async_op=False, stream=None):
        raise AssertionError("never called")

    monkeypatch.setattr(DefaultReduceScatter, "__call__", changed)
    msg = _error(f"{COLLECTIVES}.DefaultReduceScatter.__call__ is now (self, output_tensor")
    assert "our override takes exactly (self, output_tensor, input_tensor, group, op," in msg
    assert "fsdp_comm.py (CountingReduceScatter overrides it)" in msg


def test_a_public_call_that_no_longer_binds_is_named(monkeypatch):
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: None))
    _error("torch.distributed.device_mesh.DeviceMesh.from_group is now (group, device_type)")


def test_optional_api_may_be_absent_and_older_names_count(monkeypatch):
    """Without the custom-collective API (torch before it) only the counting is off; the
    divide-factor setter may go by its older name."""
    monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    monkeypatch.delattr(FSDPModule, "set_gradient_divide_factor")
    assert check_fsdp2() == ["torch.distributed.fsdp.FSDPModule.set_custom_all_gather"]
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_divide_factor")
    _error("FSDPModule.set_gradient_divide_factor or torch.distributed.fsdp.FSDPModule.set_red")


def test_a_torch_older_than_supported_is_refused(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    _error("needs torch >= 2.6 (verified on 2.13.0); this is torch 2.5.1")


def test_validation_refuses_zero3_before_any_process_group(monkeypatch):
    from megatron_lite.config import load_config
    from megatron_lite.validation import validate

    monkeypatch.delattr(FSDPModule, "set_requires_gradient_sync")
    cfg = load_config(None, [*TINY, "data.mock=true", "parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match="set_requires_gradient_sync is missing"):
        validate(cfg, 2)
    assert not torch.distributed.is_initialized()


def test_the_wrapper_checks_before_it_builds_a_mesh(monkeypatch):
    """Job 3 (the wrapper without our config): the same check, before any DeviceMesh."""
    from megatron_lite.parallel.data_parallel.fsdp import FullyShardedDataParallel

    monkeypatch.delattr(FSDPModule, "set_modules_to_forward_prefetch")
    with pytest.raises(FSDP2APIError, match="set_modules_to_forward_prefetch is missing"):
        FullyShardedDataParallel([torch.nn.Linear(2, 2)], mesh=None)


def _flags_and_fused_adamw(rank, world, overrides, out_dir):
    """One ZeRO-3 step on pp=2 × vpp=2 with 4 microbatches, recording each call of the
    gradient-sync flags (chunk, value, whether autograd was running); then fused AdamW vs the
    per-tensor path on FSDP2's DTensor parameters."""
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    calls = []
    real = {
        n: getattr(FSDPModule, n) for n in ("set_requires_gradient_sync", "set_is_last_backward")
    }

    def recording(name):
        def set_flag(self, value, **kw):
            inside = torch._C._current_graph_task_id() != -1
            calls.append((name, chunks.index(self) if self in chunks else -1, value, inside))
            return real[name](self, value, **kw)

        return set_flag

    for name in real:
        setattr(FSDPModule, name, recording(name))
    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world, pp=2)), dataset, vocab)
    chunks = trainer.chunks
    trainer.train()
    for name, fn in real.items():
        setattr(FSDPModule, name, fn)

    # fused AdamW (what CUDA runs) vs per-tensor, on DTensor parameters: those FSDP2 made
    # (sharded over dp = 1 here) and one sharded over both ranks
    from torch.distributed.tensor import Shard, distribute_tensor

    world_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    two_ranks = distribute_tensor(torch.arange(24.0).reshape(6, 4) / 7, world_mesh, [Shard(0)])
    params = [*[p for p in trainer.params if p.dim() >= 2][:2], two_ranks]
    stepped = []
    for fused in (True, False):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for c in copies:
            c.grad = torch.ones_like(c) * 1e-3 + c.detach() * 0.1
        opt = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, foreach=False, fused=fused)
        opt.step()
        opt.step()
        stepped.append([c.to_local().clone() for c in copies])
    diff = max((a - b).abs().max().item() for a, b in zip(*stepped, strict=True))
    return calls, diff, sorted({type(p).__name__ for p in params})


def test_zero3_flags_come_from_the_schedule_outside_autograd(tmp_path):
    """Each chunk hears "not last" before its first three backwards and "last" before the
    fourth, every time outside a running backward (the old tensor hook set them inside); fused
    AdamW on DTensors matches the per-tensor path after two steps."""
    args = [*TINY, f"data.paths=[{structured_dataset()}]", "model.arch=llama"]
    args += ["parallel.zero_stage=3", "parallel.pp=2", "parallel.vpp=2", "train.steps=1"]
    args += ["train.global_batch_size=8", "train.micro_batch_size=2"]
    results = run_ranks(2, _flags_and_fused_adamw, args, str(tmp_path), timeout=120)
    for rank, (calls, adamw_diff, param_types) in enumerate(results):
        inside = [c for c in calls if c[3]]
        assert not inside, f"rank {rank}: FSDP2 flags set inside a running backward: {inside}"
        for name in ("set_requires_gradient_sync", "set_is_last_backward"):
            for chunk in (0, 1):
                got = [v for n, c, v, _ in calls if n == name and c == chunk]
                assert got == [False, False, False, True], (
                    f"rank {rank} chunk {chunk} {name}: {got}"
                )
        assert param_types == ["DTensor"], param_types
        assert adamw_diff < 1e-6, f"rank {rank}: fused AdamW on DTensors differs by {adamw_diff}"
