"""The GPU acceptance run's verdicts (tools/gpu_check_verdicts.py) on the inputs only a GPU
produces: the CPU run of tools/gpu_check.sh (tests/launch/test_gpu_check.py) never takes the
branches that judge compiled bf16 kernels, Triton timings, the allocator's peaks or a backend
off the band. Each case feeds what the tool would read and asks for the verdict and its why."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "gpu_check_verdicts", os.path.join(ROOT, "tools", "gpu_check_verdicts.py")
)
v = sys.modules.setdefault("gpu_check_verdicts", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(v)  # registered first: its dataclass looks itself up there


def _junit(tmp_path, cases):
    """cases: (name, outcome) with outcome "pass", "fail" or "skip"."""
    body = []
    for name, outcome in cases:
        inner = {"pass": "", "fail": '<failure message="diverges">x</failure>',
                 "skip": '<skipped message="needs a GPU: interpreter"/>'}[outcome]  # fmt: skip
        body.append(f'<testcase classname="tests.kernels.t" name="{name}">{inner}</testcase>')
    path = tmp_path / "junit.xml"
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return str(path)


def _status(items):
    return {i.name: i.status for i in items}


def test_kernel_tests_on_a_gpu_must_run_every_dtype(tmp_path):
    ok = [("test_rms_norm[(2, 64)-fp32]", "pass"), ("test_rms_norm[(2, 64)-bf16]", "pass"),
          ("test_swiglu[(3, 8)-fp16]", "pass"), ("test_dispatch", "pass")]  # fmt: skip
    assert set(_status(v.kernel_test_items(_junit(tmp_path, ok), True, None)).values()) == {"pass"}
    skipped = [*ok[:2], ("test_swiglu[(3, 8)-fp16]", "skip"), ok[3]]
    items = {i.name: i for i in v.kernel_test_items(_junit(tmp_path, skipped), True, None)}
    assert items["kernels/fp16"].status == "fail"  # a GPU that skips fp16 did not check it
    assert "skipped on the GPU" in items["kernels/fp16"].detail
    on_cpu = v.kernel_test_items(_junit(tmp_path, skipped), False, None)
    assert _status(on_cpu)["kernels/fp16"] == "skipped"  # the interpreter cannot run fp16
    failed = [("test_rms_norm[(2, 64)-bf16]", "fail"), *ok[2:]]
    items = {i.name: i for i in v.kernel_test_items(_junit(tmp_path, failed), True, None)}
    assert (
        items["kernels/bf16"].status == "fail" and "test_rms_norm" in items["kernels/bf16"].detail
    )
    assert items["kernels/fp32"].status == "fail"  # no fp32 test ran at all


def _bench(tmp_path, triton_bwd_ms, note=None):
    rows = []
    for op in ("rms_norm", "swiglu"):
        rows.append({"op": op, "provider": "torch", "fwd_ms": 2.0, "bwd_ms": 4.0,
                     "fwd_frac_copy": 0.3, "bwd_frac_copy": 0.3})  # fmt: skip
        tri = {"op": op, "provider": "triton", "fwd_ms": 0.5, "bwd_ms": triton_bwd_ms,
               "fwd_frac_copy": 0.9, "bwd_frac_copy": 0.8}  # fmt: skip
        rows.append({"op": op, "provider": "triton", "note": note} if note else tri)
    path = tmp_path / "bench_kernels.json"
    meta = {"copy_gbs": 4000.0, "dtype": "bf16"}
    path.write_text(json.dumps({"meta": meta, "results": rows}))
    return str(path)


def test_bench_passes_when_triton_beats_eager_torch(tmp_path):
    item = v.bench_item(_bench(tmp_path, 1.0), True, None)
    assert item.status == "pass" and "80%-90% of copy bandwidth" in item.detail, item.detail
    slow = v.bench_item(_bench(tmp_path, 5.0), True, None)
    assert slow.status == "fail" and "rms_norm bwd 5.000 ms slower" in slow.detail
    broken = v.bench_item(_bench(tmp_path, 1.0, note="error: CompilationError"), True, None)
    assert broken.status == "fail" and "CompilationError" in broken.detail


def _summary(losses):
    n = len(losses)
    records = [{"step": i, "loss": x, "grad_norm": 1.0, "tokens_per_s": 5e4,
                "tflops_per_rank": 400.0, "mfu": 0.4, "step_time_s": 0.3,
                "mem/allocated_peak": 100, "mem/reserved_peak": 120}
               for i, x in enumerate(losses)]  # fmt: skip
    return v.summarize(records, n)


FALLING = [8.3 - 0.07 * i for i in range(30)]  # 8.3 -> 6.27: learns


def test_loss_band_against_the_plain_run():
    plain = v.plain_item(_summary(FALLING), None, real_data=True)
    assert plain.status == "pass", plain.detail
    near = v.backend_item("te", _summary([x * 1.01 for x in FALLING]), None, plain, fp8=False)
    assert near.status == "pass", near.detail
    off = v.backend_item("te", _summary([x * 1.025 for x in FALLING]), None, plain, fp8=False)
    assert off.status == "fail" and "band 2%" in off.detail, off.detail
    fp8 = v.backend_item("te_fp8", _summary([x * 1.025 for x in FALLING]), None, plain, fp8=True)
    assert fp8.status == "pass", fp8.detail
    crashed = v.backend_item("flash", _summary(FALLING[:12]), "exit 1: oom", plain, fp8=False)
    assert crashed.status == "fail" and "oom" in crashed.detail


def test_a_plain_run_that_does_not_learn_gives_no_verdict():
    flat = [8.3] * 30
    plain = v.plain_item(_summary(flat), None, real_data=True)
    assert plain.status == "fail" and "less than the 5%" in plain.detail
    same = v.backend_item("selective", _summary(flat), None, plain, fp8=False)
    assert same.status == "fail" and "no verdict" in same.detail
    assert v.plain_item(_summary(flat), None, real_data=False).status == "pass"  # mock data


def _dry(tmp_path, peak, predicted):
    path = tmp_path / "dry_run.json"
    path.write_text(json.dumps([{"peak_bytes": peak, "predicted_peak_bytes": predicted,
                                 "by_category": {}, "predicted": {}}]))  # fmt: skip
    return str(path)


@pytest.mark.parametrize("allocated, status", [(102, "pass"), (96, "pass"), (108, "fail")])
def test_memory_allocator_peak_within_band_of_dry_run_and_planner(tmp_path, allocated, status):
    plain = v.plain_item(_summary(FALLING), None, real_data=True)
    plain.data["memory"] = {"allocated_peak": allocated, "reserved_peak": allocated * 1.2}
    item = v.memory_item(plain, _dry(tmp_path, 100, 101), True, None)
    assert item.status == status, item.detail
    assert item.data["warnings"] and "fragmentation reserve" in item.data["warnings"][0]


def test_resume_must_repeat_every_loss_bit_for_bit():
    ref = _summary(FALLING)
    resumed = {**ref, "steps": ref["steps"][10:], "losses": ref["losses"][10:],
               "grad_norms": ref["grad_norms"][10:]}  # fmt: skip
    ok = v.resume_item(ref, resumed, 10, None)
    assert ok.status == "pass" and ok.data["compared_steps"] == [11, 30], ok.detail
    resumed["losses"] = [
        *resumed["losses"][:5],
        resumed["losses"][5] + 1e-7,
        *resumed["losses"][6:],
    ]
    bad = v.resume_item(ref, resumed, 10, None)
    assert bad.status == "fail" and bad.data["first_differing_step"] == 16, bad.detail
    short = {**resumed, "steps": resumed["steps"][:-1]}
    short["losses"], short["grad_norms"] = resumed["losses"][:-1], resumed["grad_norms"][:-1]
    assert v.resume_item(ref, short, 10, None).status == "fail"


def test_a_kernel_falling_back_to_torch_fails_the_run():
    """The warning kernels/selfcheck.py really prints, as a run's log holds it."""
    from megatron_lite.kernels import selfcheck

    def broken(device, dtype, shape_class):
        raise selfcheck.KernelMismatch("output 0 diverges")

    with pytest.warns(RuntimeWarning) as caught:
        assert not selfcheck.passed("gpu_check_test", torch.bfloat16, (64,), "cpu", broken)
    line = f"/x/kernels/dispatch.py:41: RuntimeWarning: {caught[0].message}"
    summary = _summary(FALLING)
    assert v.run_failure(summary, 30, None, "") is None
    summary["warnings"] = [line]
    why = v.run_failure(summary, 30, None, "")
    assert why and "gpu_check_test" in why and "torch reference ran" in why, why
