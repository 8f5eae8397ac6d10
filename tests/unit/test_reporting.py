"""The step's reporting alone (no Trainer): MFU against Megatron's published FLOPs formula, the
mem/* fields of MemoryReport on a tiny model (model states per the ZeRO paper's byte counts,
the activation peak counted by hand), when the report is reduced, and the peak line."""

import pytest
import torch

from megatron_lite.config import load_config
from megatron_lite.training.flops import model_flops_per_token
from megatron_lite.training.reporting import Throughput, peak_line, peak_tflops_of
from tests.dist_harness import run_ranks

# a GPT with Megatron's shape: MHA, MLP 4h (GeLU), untied output layer, no vocabulary padding
GPT = ["model.arch=gpt", "model.vocab_size=512", "model.num_layers=3", "model.hidden_size=64",
       "model.num_attention_heads=4", "model.ffn_hidden_size=256", "model.seq_length=32",
       "train.micro_batch_size=2", "train.global_batch_size=8", "data.mock=true"]  # fmt: skip


def test_mfu_against_megatrons_formula():
    """Narayanan et al. 2021 (eq. 3): a step of B sequences costs 72·B·s·l·h²·(1 + s/(6h) +
    V/(12·h·l)) FLOPs, counting the full s×s attention scores; the causal mask halves those,
    6·B·s²·l·h of it (the convention of our 6N + 6·L·s·q, README "Model FLOPs")."""
    cfg = load_config(None, GPT)
    B, s, l, h, V = 8, 32, 3, 64, 512  # noqa: E741
    megatron = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * h * l)) - 6 * B * s**2 * l * h
    tokens = B * s
    world, dt, peak = 4, 0.25, 989.0
    figures = Throughput(model_flops_per_token(cfg) * tokens, tokens, world, peak)(dt)
    tflops = megatron / dt / world / 1e12
    assert figures["tflops_per_rank"] == pytest.approx(tflops, rel=1e-12)
    assert figures["mfu"] == pytest.approx(tflops / peak, rel=1e-12)
    assert figures["tokens_per_s"] == tokens / dt and figures["step_time_s"] == dt
    assert list(figures) == ["tokens_per_s", "step_time_s", "tflops_per_rank", "mfu"]
    no_peak = Throughput(1e12, tokens, world, peak_tflops_of(torch.device("cpu"), rank=0))(dt)
    assert "mfu" not in no_peak, "no MFU without a known GPU peak"


N_IN, N_HID, N_OUT, BATCH = 8, 16, 2, 4
F32 = 4


def _memory_report(rank, world):
    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.training.reporting import MemoryReport

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(N_IN, N_HID), torch.nn.ReLU(),
                                torch.nn.Linear(N_HID, N_OUT))  # fmt: skip
    dp = build_data_parallel([model], ParallelMesh(RankLayout(world)), zero_stage=0,
                             betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    dp.optimizer.sync_masters_from_params()
    params = list(model.parameters())
    report = MemoryReport(dp, [model], params, torch.device("cpu"), memory_steps=1,
                          reports_at=lambda step: step == 2)  # fmt: skip
    out = {"before": report.report()}

    def step():  # forward + backward (metered) and the optimizer
        dp.start_step(1)

        def fwd_bwd():
            loss = model(torch.randn(BATCH, N_IN)).sum()
            loss.backward()
            return loss

        report.measure(fwd_bwd, num_microbatches=1, step=n)
        dp.finish_grad_sync()
        dp.step()

    reduced = []  # one entry per report() (its all-reduce; a 1-rank group skips the call)
    reduce = report.report
    report.report = lambda: reduced.append(1) or reduce()

    def reductions():
        n, reduced[:] = len(reduced), []
        return n

    for n in range(4):
        with report.tracked():
            tracked = report.tracker is not None
            step()
            mem = report.step_memory(activations_changed=n == 3)
        out[n] = (tracked, mem, reductions(), report.last_activation_report)
    return out


def test_memory_report_fields():
    out = run_ranks(1, _memory_report, timeout=60)[0]
    n_params = N_IN * N_HID + N_HID + N_HID * N_OUT + N_OUT
    # model states before any step, as allocated: fp32 weights (they are the masters), fp32
    # gradients, AdamW's two moments: 4 + 4 + 8 bytes per parameter (ZeRO paper, no ZeRO)
    before = out["before"]
    assert list(before) == ["mem/weights", "mem/grads", "mem/master", "mem/optimizer"]
    assert before["mem/weights"] == before["mem/grads"] == F32 * n_params
    assert before["mem/master"] == 0
    assert 2 * F32 * n_params <= before["mem/optimizer"] <= 2 * F32 * n_params + 64, before
    # step 0 is tracked: the peak by category, and the activation peak the meter saw: the
    # first Linear saves its input [4, 8], ReLU its output [4, 16] (which the second Linear
    # saves too: one storage), the weights are excluded
    tracked, mem, calls, saved = out[0]
    activations = F32 * BATCH * (N_IN + N_HID)
    assert tracked and calls == 1
    cats = ["weights", "grads", "master", "optimizer", "buffers", "gathered", "activations",
            "temporaries"]  # fmt: skip
    assert list(mem) == [f"mem/{k}" for k in [*cats, "step_peak", "activations_peak"]]
    assert mem["mem/step_peak"] == sum(mem[f"mem/{k}"] for k in cats)
    assert mem["mem/weights"] == before["mem/weights"]
    assert mem["mem/activations_peak"] == saved["peak_bytes"] == activations
    assert saved["num_microbatches"] == 1 and saved["recomputed_bytes"] == 0
    # step 1: no longer tracked (memory_steps=1), not metered (not a reporting step), nothing
    # changed: the last report, no collective
    tracked, mem1, calls, _ = out[1]
    assert not tracked and mem1 == mem and calls == 0
    # step 2 is a reporting step (metered again, same bytes: no collective); step 3 flagged a
    # changed activation peak on some rank: reduced again
    assert out[2][1] == mem and out[2][2] == 0
    assert out[3][1] == mem and out[3][2] == 1


def test_peak_line_lists_the_categories_present_in_mib():
    mem = {"mem/weights": 2**20, "mem/grads": 0, "mem/activations": 3 * 2**19,
           "mem/step_peak": 5 * 2**19, "mem/activations_peak": 7}  # fmt: skip
    assert peak_line(mem) == (
        "[memory] step peak per rank (max over ranks, MiB): weights 1.0, activations 1.5; total 2.5"
    )
