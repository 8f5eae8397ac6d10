"""tools/plot_run.py: two run directories written by the project's own writers (MetricsLogger's
metrics.jsonl, save_config's config.yaml) are plotted into one PNG, and every line of the
returned Figure holds exactly the values metrics.jsonl holds (read back with json, tokens as
consumed_samples times the config's seq_length); bad directories and arguments are named."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from megatron_lite.config import load_config, save_config
from megatron_lite.training.logging import MetricsLogger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "plot_run", os.path.join(ROOT, "tools", "plot_run.py")
)
plot_run = importlib.util.module_from_spec(_spec)
sys.modules["plot_run"] = plot_run  # its dataclass looks its module up there
_spec.loader.exec_module(plot_run)


def write_run(out_dir, seq_length: int, steps: int, gpu: bool, seed: int) -> None:
    """A run directory as the trainer leaves it: config.yaml and metrics.jsonl (random
    figures; eval_loss every 4 steps; the memory field a GPU run or a CPU run reports)."""
    rng = np.random.default_rng(seed)
    cfg = load_config(None, [f"train.out_dir={out_dir}", f"model.seq_length={seq_length}",
                             "train.global_batch_size=8", "log.progress=false"])  # fmt: skip
    os.makedirs(out_dir)
    save_config(cfg, os.path.join(out_dir, "config.yaml"))
    logger = MetricsLogger(cfg, active=True)
    for step in range(steps):
        record = {
            "step": step,
            "loss": float(rng.uniform(2, 9)),
            "lr": float(rng.uniform(0, 1e-3)),
            "grad_norm": float(rng.uniform(0, 5)),
            "tokens_per_s": float(rng.uniform(1e3, 1e4)),
            "consumed_samples": 8 * (step + 1),
            "mem/step_peak": int(rng.integers(1 << 20, 1 << 30)),
        }
        if gpu:
            record["mem/allocated_peak"] = int(rng.integers(1 << 20, 1 << 30))
        if step % 4 == 3:
            record["eval_loss"] = float(rng.uniform(2, 9))
        logger.log(record, first_step=0)
    logger.close()


@pytest.fixture
def runs(tmp_path):
    a, b = str(tmp_path / "cpu_run"), str(tmp_path / "gpu_run")
    write_run(a, seq_length=16, steps=10, gpu=False, seed=1)
    write_run(b, seq_length=32, steps=7, gpu=True, seed=2)
    return a, b


def lines_of(fig) -> dict[tuple[str, str], tuple[list, list]]:
    """{(panel title, line label): (x, y)} of every line in the figure."""
    out = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            key = (ax.get_title(), line.get_label())
            assert key not in out, f"two lines {key}"
            out[key] = (list(line.get_xdata()), list(line.get_ydata()))
    return out


def expected_lines(run_dir: str, name: str, seq_length: int, memory: str):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]

    def xy(key, x="step", scale=1):
        rows = [r for r in records if key in r]
        xs = [r["step"] if x == "step" else r["consumed_samples"] * seq_length for r in rows]
        return xs, [r[key] / scale for r in rows]

    return {
        ("loss", name): xy("loss"),
        ("loss", f"{name} eval"): xy("eval_loss"),
        ("loss against tokens", name): xy("loss", "tokens"),
        ("loss against tokens", f"{name} eval"): xy("eval_loss", "tokens"),
        ("throughput", name): xy("tokens_per_s"),
        ("grad norm", name): xy("grad_norm"),
        ("learning rate", name): xy("lr"),
        ("peak memory per rank", name): xy(memory, scale=2**20),
    }


def test_lines_hold_the_metrics_of_both_runs(runs, tmp_path, capsys):
    a, b = runs
    out = str(tmp_path / "plot.png")
    assert plot_run.main([a, b, "--out", out, "--label", "A", "--label", "B"]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert f"wrote {out} (A: 10 steps, B: 7 steps)" in capsys.readouterr().out
    fig = plot_run.plot_runs([plot_run.load_run(a), plot_run.load_run(b)])
    got = lines_of(fig)
    want = {
        **expected_lines(a, "cpu_run", 16, "mem/step_peak"),
        **expected_lines(b, "gpu_run", 32, "mem/allocated_peak"),  # a GPU's allocator peak
    }
    assert set(got) == set(want), (
        f"lines: extra {set(got) - set(want)}, missing {set(want) - set(got)}"
    )  # noqa: E501
    for key, (x, y) in want.items():
        assert got[key] == (x, y), f"{key}: plotted {got[key]} != metrics.jsonl {(x, y)}"
    legends = {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()]
               for ax in fig.axes}  # fmt: skip
    assert legends["throughput"] == ["cpu_run", "gpu_run"], legends


def test_torn_last_record_is_skipped_with_a_warning(runs, capsys):
    a, _ = runs
    with open(os.path.join(a, "metrics.jsonl"), "a") as f:
        f.write('{"step": 10, "lo')  # the run died mid-write
    run = plot_run.load_run(a)
    assert [r["step"] for r in run.records] == list(range(10))
    assert "metrics.jsonl line 11 is not a whole record, skipped" in capsys.readouterr().err


def test_bad_runs_and_arguments_are_named(runs, tmp_path, capsys):
    a, _ = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([str(tmp_path / "nope")], f"{tmp_path / 'nope'}: no such directory"),
        ([str(empty)], f"{empty} has no metrics.jsonl, so it is not a run directory"),
    ]
    for argv, needle in cases:
        assert plot_run.main([a, *argv, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err, err
    os.remove(os.path.join(a, "config.yaml"))
    assert plot_run.main([a, "--out", str(tmp_path / "x.png")]) == 2
    assert "config.yaml: cannot read model.seq_length" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.png"), "a failed plot wrote a file"
    with pytest.raises(SystemExit) as e:
        plot_run.main([a, "--label", "x", "--label", "y"])
    assert e.value.code == 2 and "--label given 2 time(s) for 1 run(s)" in capsys.readouterr().err
