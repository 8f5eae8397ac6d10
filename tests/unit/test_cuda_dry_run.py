"""plan --dry-run --device cuda (plan/cuda_dry_run.py): the step on fake CUDA tensors, its
device placement checked and its host syncs counted (docs/cuda_dry_run.md).

- the stand-in CUDA runtime is installed inside the dry run only: every patched attribute is
  the original again after it;
- a tensor made without `device=` inside a layer's forward is a DeviceMismatch naming the
  line that made it (this file's), and a CPU tensor mixed into a device op names the op's line;
- host syncs per steady step are bounded (docs/cuda_dry_run.md "The bound"): a dense layout
  has none in its microbatch loop and 4 in all; an MoE layout has, in its loop, exactly one
  dispatch read (the all-to-all's split sizes) and one router read (the aux loss's token
  count) per MoE layer and microbatch, in the forward only (no recompute), counted by hand
  below from the layout."""

import pytest
import torch

from tests.dist_harness import run_alone
from tests.parallel.parity import TINY

DENSE = (1, ["parallel.zero_stage=1"])
MOE = (2, ["parallel.dp=2", "parallel.ep=2", "model.num_experts=4", "model.moe_ffn_hidden_size=64",
           "model.moe_aux_loss_coeff=0.01"])  # fmt: skip


def _config(world, overrides, out_dir):
    import dataclasses

    from megatron_lite.plan.dry_run import dry_run_config
    from megatron_lite.train import prepare

    cfg, _, _ = prepare([*TINY, *overrides, "data.mock=true"], world, hardware=False)
    cfg = dry_run_config(cfg, out_dir, microbatches=None)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=out_dir))


def _cuda_rank(world, overrides, out_dir, inject=None):
    """run_rank(device="cuda") of rank 0 -> (device, host_syncs, microbatches), or the
    DeviceMismatch's message and line when `inject` ("zeros" or "mix") plants a mistake in
    the first layer's MLP forward."""
    from megatron_lite.models import transformer as mlp
    from megatron_lite.plan.device_check import DeviceMismatch
    from megatron_lite.plan.dry_run import run_rank

    cfg = _config(world, overrides, out_dir)
    if inject is not None:
        forward = mlp.MLP.forward

        def planted(self, x):
            if inject == "zeros":
                bias = torch.zeros(x.shape[-1])  # PLANTED: no device=
            else:
                bias = torch.zeros(x.shape[-1], device=x.device).cpu()
            return forward(self, x + bias)  # PLANTED MIX

        mlp.MLP.forward = planted
    try:
        r = run_rank(cfg, world, 0, "torch", device="cuda")
    except DeviceMismatch as e:
        return str(e), e.where
    finally:
        if inject is not None:
            mlp.MLP.forward = forward
    return r.device, r.host_syncs, r.microbatches


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "def " not in text)


def test_stand_ins_live_only_inside_the_dry_run():
    from megatron_lite.plan.cuda_dry_run import cuda_step

    names = ("is_available", "current_device", "Stream", "Event", "synchronize")
    before = [getattr(torch.cuda, n) for n in names]
    methods = [torch.Tensor.to, torch.Tensor.pin_memory, torch.Tensor.record_stream]
    with cuda_step(11, 8) as audit:  # rank 11 of 8-GPU nodes: local rank 3
        assert torch.cuda.is_available() and torch.cuda.current_device() == 3
        w = torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))
        (w.to(torch.bfloat16).float() @ w[1:].t()).sum().backward()
        assert str(w.grad.device) == audit.device == "cuda:3" and w.is_cuda
        assert w.cpu().pin_memory().device.type == "cpu"
        torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
    assert [getattr(torch.cuda, n) for n in names] == before
    assert [torch.Tensor.to, torch.Tensor.pin_memory, torch.Tensor.record_stream] == methods
    assert torch.cuda.is_available() is False  # this CPU-only torch again
    kinds = [s.kind for s in audit.syncs.syncs]
    assert kinds == ["device-to-host copy", "Stream.synchronize", "torch.cuda.synchronize"]


@pytest.mark.parametrize("inject", ["zeros", "mix"])
def test_a_misplaced_tensor_is_named_with_its_line(inject, tmp_path):
    message, where = run_alone(_cuda_rank, *DENSE, str(tmp_path), inject, timeout=120)
    here = "tests/unit/test_cuda_dry_run.py"
    if inject == "zeros":
        assert where == f"{here}:{_line('PLANTED: no device=')} in planted", message
        assert message.startswith(f"tensor created on cpu at {where} (expected cuda:0)")
    else:
        assert where == f"{here}:{_line('PLANTED MIX')} in planted", message
        assert "mixes cpu and cuda:0 tensors" in message


@pytest.mark.slow  # two dry runs (~30 s on the shared 2-core machine): CI's second tier
def test_host_syncs_per_step_are_bounded(tmp_path):
    """docs/cuda_dry_run.md's bound, on a dense and an MoE layout."""
    device, dense, _ = run_alone(_cuda_rank, *DENSE, str(tmp_path / "d"), timeout=120)
    assert device == "cuda:0"
    phases = {}
    for key, n in dense.items():
        phase = key.split("|")[0]
        phases[phase] = phases.get(phase, 0) + n
    # the token count, the norm/loss read, the memory report's maxima, the step's timing
    assert phases == {"before forward": 1, "norm/loss": 1, "logging": 2}, dense

    _, moe, m = run_alone(_cuda_rank, *MOE, str(tmp_path / "m"), timeout=120)
    loop = {k: n for k, n in moe.items() if k.split("|")[0] in ("forward", "backward")}
    layers = 4  # model.num_layers (TINY), every one MoE (moe_layer_freq 1)
    want = {"forward|host.read|megatron_lite/moe/dispatcher.py": m * layers,
            "forward|host.read|megatron_lite/moe/router.py": m * layers}  # fmt: skip
    got = {}
    for key, n in loop.items():
        site = key.split(":")[0]  # "phase|kind|file"
        got[site] = got.get(site, 0) + n
    assert got == want, moe
