"""A 1-rank run: profile_steps writes a Chrome trace that parses, metrics.jsonl carries
mem/activations_peak (equal to the step's saved-tensor report) and tflops_per_rank (the FLOPs
formula over the step time), the saved-tensor meter runs only on the steps that report, and
profile_steps is validated."""

import json
import os

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate
from tests.dist_harness import run_ranks

TINY = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=16",
        "train.micro_batch_size=2", "train.global_batch_size=4", "data.mock=true",
        "log.progress=false"]  # fmt: skip


def _train(rank, world, overrides, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    trainer.train()
    return trainer.last_activation_report, trainer.flops_per_step


def test_profile_trace_and_step_metrics(tmp_path):
    out = str(tmp_path / "run")
    overrides = [*TINY, "train.steps=3", "train.profile_steps=[1,2]"]
    report, flops = run_ranks(1, _train, overrides, out, timeout=90)[0]
    trace = os.path.join(out, "profile", "rank0", "trace_steps1-2.json")
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 1", "step 2"} <= names and "step 0" not in names
    assert any(e.get("name") == "[memory]" for e in events), "no memory events in the trace"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for r in records:
        assert r["mem/activations_peak"] == report["peak_bytes"] > 0  # dense: same every step
        assert r["tflops_per_rank"] == pytest.approx(flops / r["step_time_s"] / 1e12)
        assert "mfu" not in r  # CPU: no peak to compare with
    labels = report["by_label"]
    assert set(labels) == {"embedding", "layer.0", "layer.1", "output/loss"}, labels
    assert labels["layer.0"] == labels["layer.1"], "identical layers save the same bytes"


def _metered_steps(rank, world, overrides, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training import activation_memory, reporting, trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    t = trainer.Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    metered = []

    class CountingMeter(activation_memory.SavedTensorMeter):
        def __enter__(self):
            metered.append(t.step)
            return super().__enter__()

    reporting.SavedTensorMeter = CountingMeter  # the one MemoryReport.measure uses
    records = t.train()
    return metered, [r["mem/activations_peak"] for r in records]


def test_meter_runs_on_the_first_step_and_the_reporting_steps(tmp_path):
    """log.interval=3 over 7 steps: metered on step 0 (the first), 2 and 5 (ends of intervals)
    and 6 (the last); every record still carries the (same, dense) activation peak."""
    overrides = [*TINY, "train.steps=7", "log.interval=3"]
    metered, peaks = run_ranks(1, _metered_steps, overrides, str(tmp_path), timeout=90)[0]
    assert metered == [0, 2, 5, 6], metered
    assert len(peaks) == 7 and len(set(peaks)) == 1 and peaks[0] > 0, peaks


@pytest.mark.parametrize(
    "steps,needle",
    [
        ("[2]", "must be [] (off) or two step numbers"),
        ("[2,1]", "0 <= first <= last"),
        ("[1,3]", "< train.steps=3"),
    ],  # fmt: skip
)
def test_profile_steps_validation(steps, needle):
    cfg = load_config(None, [*TINY, "train.steps=3", f"train.profile_steps={steps}"])
    with pytest.raises(ConfigError, match="train.profile_steps") as e:
        validate(cfg, 1)
    assert needle in str(e.value)


def test_memory_snapshot_needs_profile_steps_and_cuda():
    cfg = load_config(None, [*TINY, "train.profile_memory_snapshot=true"])
    with pytest.raises(ConfigError, match="set train.profile_steps"):
        validate(cfg, 1)
    from megatron_lite.validation.profiling import check_profile_hardware

    cfg.train.profile_steps = [0, 0]
    check_profile_hardware(cfg, cuda=True)
    with pytest.raises(ConfigError, match="no CUDA device"):
        check_profile_hardware(cfg, cuda=False)
