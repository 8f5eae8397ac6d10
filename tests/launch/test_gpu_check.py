"""tools/gpu_check.sh --cpu end to end: the GPU acceptance run on CPU with a tiny model, so the
script cannot rot while no GPU is at hand. Every item is reported in order with a line, the
report holds the figures the README's "First run on GPUs" names, every item not skipped passed,
and the skipped ones are exactly those that need a GPU, each saying why."""

import json
import os
import subprocess

import pytest

# the CPU run of every item (~50 s): in the slow tier (the suite's budget after #40/#41)
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITEMS = [
    "kernels/fp32", "kernels/bf16", "kernels/fp16", "kernels/other", "kernel_bench",
    "train/plain", "memory", "train/selective", "train/full", "train/te", "train/te_fp8",
    "train/fp8_tensorwise", "train/fp8_rowwise", "train/flash", "train/compile", "resume",
    "wall_time",
]  # fmt: skip
NEED_A_GPU = {
    "kernels/bf16": "needs a GPU",
    "kernels/fp16": "needs a GPU",
    "kernel_bench": "need a GPU",
    "train/te": "needs a CUDA GPU",
    "train/te_fp8": "needs a CUDA GPU",
    "train/flash": "needs a CUDA GPU",
    "train/compile": "needs a CUDA GPU",
    "train/fp8_tensorwise": "GPU only",
    "train/fp8_rowwise": "GPU only",
    "wall_time": "no budget on CPU",
}


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    run = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--cpu", "--out-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=270,
    )
    report = out / "report.json"
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    items = {i["name"]: i for i in json.loads(report.read_text())["items"]}
    return run, json.loads(report.read_text()), items, str(report)


@pytest.mark.timeout(300)
def test_every_item_passes_or_says_why_it_needs_a_gpu(check):
    run, report, items, path = check
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert list(items) == ITEMS
    assert report["mode"] == "cpu" and report["passed"] and report["schema"].endswith("/1")
    for name, item in items.items():
        if name in NEED_A_GPU:
            assert item["status"] == "skipped", item
            assert NEED_A_GPU[name] in item["detail"], item
        else:
            assert item["status"] == "pass", item
    lines = run.stdout.splitlines()
    for name, item in items.items():  # one line per item, as in the report
        word = {"pass": "PASS", "skipped": "SKIP"}[item["status"]]
        assert any(ln.startswith(word) and f" {name} " in ln for ln in lines), (name, lines)
    assert lines[-1] == f"report: {path}"


def test_report_holds_the_figures(check):
    _, report, items, _ = check
    assert set(report["bands"]) >= {"loss_tail_rel", "memory_rel", "resume"}
    steps = report["steps"]
    for name in ("train/plain", "train/selective", "train/full"):
        data = items[name]["data"]
        assert len(data["losses"]) == steps and data["tokens_per_s"] > 0, (name, data)
        assert data["tflops_per_rank"] > 0 and data["mfu"] is None, data  # no MFU on CPU
        assert "megatron_lite.train" in data["command"]
    for name in ("train/selective", "train/full"):  # recompute repeats the forward exactly
        assert items[name]["data"]["bitwise_equal_to_plain"], items[name]
    mem = items["memory"]["data"]
    assert mem["measured"] == "step_peak" and mem["reserved_bytes"] is None  # no allocator
    assert abs(mem["vs_dry_run"]) <= mem["band"] and abs(mem["vs_planner"]) <= mem["band"]
    resume = items["resume"]["data"]
    assert resume["losses_bitwise"] and resume["grad_norms_bitwise"]
    assert resume["compared_steps"] == [report["save_at"] + 1, steps]
    fp32 = items["kernels/fp32"]["data"]
    assert fp32["passed"] > 0 and not fp32["failed"]
    bench = items["kernel_bench"]["data"]
    assert bench["copy_gbs"] > 0 and len(bench["ops"]) == 5
    assert all(op["torch"]["fwd_ms"] > 0 for op in bench["ops"].values()), bench
