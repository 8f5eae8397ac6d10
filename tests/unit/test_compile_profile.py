"""tools/compile_profile.py (bench_compile --profile): the op categories of a profiled step and
the GEMM floor's recording of a step's GEMMs."""

from types import SimpleNamespace

import pytest
import torch

from tools.compile_profile import CATEGORIES, category, gemm_floor, profile_steps


def _ev(name: str, parent=None):
    return SimpleNamespace(name=name, cpu_parent=parent)


def test_categories_by_name_and_by_the_optimizer_ancestor():
    step = _ev("Optimizer.step#AdamW.step")
    assert category(_ev("aten::mm")) == "GEMM"
    assert category(_ev("aten::addmm_")) == "GEMM"
    assert category(_ev("aten::_scaled_dot_product_flash_attention_for_cpu_backward")) == "SDPA"
    assert category(_ev("## Call CompiledFxGraph fabc ##")) == "inductor kernels"
    assert category(_ev("gloo:all_reduce")) == "collectives"
    # the same elementwise op: the optimizer's under Optimizer.step, else the model's
    assert category(_ev("aten::mul_", _ev("aten::_foreach_mul_", step))) == "optimizer"
    assert category(_ev("aten::mul_")) == "other aten"
    assert category(_ev("aten::linalg_vector_norm")) == "optimizer"  # the gradient clip


@pytest.mark.slow  # the profiler's start-up: ~20 s on the shared 2 cores
def test_profile_splits_the_step_cpu_time_over_the_categories():
    torch.manual_seed(0)
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    prof = profile_steps(lambda: (x @ w).relu_().sum(), 1)
    # one step: its categories (no collectives here) are scaled to sum to its CPU time
    assert abs(sum(prof[c] for c in CATEGORIES) - prof["step"]) < 1e-9 * max(prof["step"], 1)
    assert prof["GEMM"] > 0 and prof["collectives"] == 0


def test_gemm_floor_replays_the_gemms_only():
    x, w = torch.randn(32, 16), torch.randn(16, 8)
    calls = []

    def step():
        calls.append(1)
        (x @ w).add_(1.0).exp_()

    floor = gemm_floor(step)
    assert calls == [1]  # the step ran once, recorded
    assert set(floor) == {"GEMM"} and floor["GEMM"] > 0  # the mm, replayed alone
