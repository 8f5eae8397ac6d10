"""The overlapped tensor-parallel linear (parallel/linear_async.py) on tp2, with and without
sequence parallelism, against plain float64 F.linear on the full weights: outputs and
gradients, the deferred-wgrad path, accumulation into main_grad (also through a GradBuffer,
whose bucket must still be launched during backward), and the bytes saved for backward."""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_harness import run_ranks

S, B, H, OUT = 8, 2, 12, 24  # column: H -> OUT, row: OUT -> H


def _full_tensors():
    g = torch.Generator().manual_seed(0)
    shapes = {"x": (S, B, H), "w1": (OUT, H), "b1": (OUT,), "w2": (H, OUT), "b2": (H,)}
    t = {k: torch.randn(v, generator=g, dtype=torch.float64) for k, v in shapes.items()}
    t["gout"] = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    return t


def _reference(t, scale=1.0):
    """Plain float64 torch: y, dx, dw1, db1, dw2, db2 for the output gradient scale·gout."""
    x, w1, b1, w2, b2 = (t[k].clone().requires_grad_() for k in ("x", "w1", "b1", "w2", "b2"))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(scale * t["gout"])
    return {"y": y.detach(), "dx": x.grad, "dw1": w1.grad, "db1": b1.grad}, {
        "dw2": w2.grad,
        "db2": b2.grad,
    }


def _err(a, b) -> float:
    return float((a.detach().double() - b).abs().max() / b.abs().max())


def _on_ranks(rank, world, sp):
    from megatron_lite.parallel.data_parallel.buffers import GradBuffer
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_lite.parallel.linear_async import defer_wgrad, run_wgrads
    from megatron_lite.parallel.params import shard

    group = dist.group.WORLD
    t = _full_tensors()
    ref1, ref2 = _reference(t)
    seq = (lambda v: v.chunk(world)[rank]) if sp else (lambda v: v)

    def build(dtype):
        col = ColumnParallelLinear(H, OUT, group, sequence_parallel=sp).to(dtype)
        row = RowParallelLinear(OUT, H, group, sequence_parallel=sp).to(dtype)
        with torch.no_grad():
            col.weight.copy_(shard(t["w1"], col.weight.meta))
            col.bias.copy_(shard(t["b1"], col.bias.meta))
            row.weight.copy_(shard(t["w2"], row.weight.meta))
            row.bias.copy_(t["b2"])
        return col, row

    def step(col, row, scale=1.0, queue=None):
        x = seq(t["x"]).to(col.weight.dtype).clone().requires_grad_()
        model = torch.nn.Sequential(col, torch.nn.GELU(), row)
        with defer_wgrad(model, queue) if queue is not None else contextlib.nullcontext():
            y = model(x)
        y.backward(scale * seq(t["gout"]).to(y.dtype))
        return y, x

    def errors(col, row, y, x, dw1, dw2, scale=1.0):
        row_db = row.bias.grad.clone()
        if sp:  # the row bias saw a sequence shard: finalization sums its grad over TP
            dist.all_reduce(row_db)
        got = {"y": y, "dx": x.grad, "dw1": dw1, "db1": col.bias.grad, "dw2": dw2, "db2": row_db}
        want = {**ref1, **ref2}
        want["y"], want["dx"] = seq(want["y"]), seq(want["dx"])
        want["dw1"], want["db1"] = (
            shard(want["dw1"], col.weight.meta),
            shard(ref1["db1"], col.bias.meta),
        )
        want["dw2"] = shard(want["dw2"], row.weight.meta)
        return {k: _err(got[k], scale * want[k] if k != "y" else want[k]) for k in got}

    out = {}
    col, row = build(torch.float64)
    y, x = step(col, row)
    out["plain"] = errors(col, row, y, x, col.weight.grad, row.weight.grad)

    col, row = build(torch.float64)
    queue = []
    y, x = step(col, row, queue=queue)
    out["deferred_queued"] = (len(queue), col.weight.grad is None and row.weight.grad is None)
    run_wgrads(queue)
    out["deferred"] = errors(col, row, y, x, col.weight.grad, row.weight.grad)

    def checkpointed(col, row):  # recompute: saved tensors come back through a hook
        x = seq(t["x"]).to(col.weight.dtype).clone().requires_grad_()
        model = torch.nn.Sequential(col, torch.nn.GELU(), row)
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        y.backward(seq(t["gout"]).to(y.dtype))
        return y, x

    def detaching(col, row):  # a saved-tensor hook that unpacks new tensors (a meter's kind)
        with torch.autograd.graph.saved_tensors_hooks(lambda v: v.detach(), lambda v: v):
            return step(col, row)

    for name, run in (("main_grad", step), ("recompute", checkpointed), ("hooks", detaching)):
        col, row = build(torch.float64)
        before = {}
        for p in (col.weight, row.weight):  # already holds something: the GEMM must add to it
            p.main_grad = torch.randn(p.shape, dtype=torch.float64)
            before[id(p)] = p.main_grad.clone()
        y, x = run(col, row)
        out[f"{name}_no_grad"] = col.weight.grad is None and row.weight.grad is None
        dw1, dw2 = (p.main_grad - before[id(p)] for p in (col.weight, row.weight))
        out[name] = errors(col, row, y, x, dw1, dw2)

    col, row = build(torch.float64)
    col.weight.main_grad = torch.zeros(col.weight.shape, dtype=torch.float64)
    seen = []
    col.weight.register_hook(lambda grad: seen.append(grad.clone()))
    y, x = step(col, row)
    out["hooked"] = (
        _err(seen[0], shard(ref1["dw1"], col.weight.meta)),
        _err(col.weight.grad, shard(ref1["dw1"], col.weight.meta)),
        bool(col.weight.main_grad.any()),
    )

    # a GradBuffer over one-rank data-parallel groups (fp32 buffers, the fused addmm_ path)
    single = [dist.new_group([r]) for r in range(world)][rank]
    for defer in (False, True):
        col, row = build(torch.float32)
        buf = GradBuffer([*col.parameters(), *row.parameters()], single, bucket_size=1 << 30)
        buf.start_step(2)
        queue = [] if defer else None
        for scale in (1.0, 2.0):  # two microbatches: main_grad holds 3× the reference grads
            y, x = step(col, row, scale, queue)
        launched = buf.buckets[0].work is not None
        counts = sorted(buf.counts.values())
        if defer:
            run_wgrads(queue)
        buf.finish()
        want_w1, want_w2 = shard(ref1["dw1"], col.weight.meta), shard(ref2["dw2"], row.weight.meta)
        out[f"buffer_defer={defer}"] = {
            "launched_in_backward": launched,
            "counts": counts,
            "dw1": _err(col.weight.main_grad, 3 * want_w1),
            "db1": _err(col.bias.main_grad, 3 * shard(ref1["db1"], col.bias.meta)),
            "dw2": _err(row.weight.main_grad, 3 * want_w2),
            "grads_left": [
                n
                for n, p in [*col.named_parameters(), *row.named_parameters()]
                if p.grad is not None
            ],
        }

    # bytes saved for backward by the column layer alone, parameters excluded
    col, _ = build(torch.float64)
    params = {p.untyped_storage().data_ptr() for p in col.parameters()}
    saved = []

    def pack(v):
        if v.untyped_storage().data_ptr() not in params:
            saved.append(v.untyped_storage().nbytes())
        return v

    x = seq(t["x"]).clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
        col(x)
    out["saved_bytes"] = (sum(saved), x.nbytes)
    return out


@functools.cache
def _results(sp: bool):
    return run_ranks(2, _on_ranks, sp, timeout=60)


SP = pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])


def _check(errs: dict, what: str, rank: int, tol: float = 1e-12):
    for k, e in errs.items():
        assert e < tol, f"{what}, rank {rank}, {k}: relative error {e:.3g} against float64 F.linear"


@SP
def test_output_and_grads_match_float64_reference(sp):
    for rank, r in enumerate(_results(sp)):
        _check(r["plain"], "overlapped linear", rank)


@SP
def test_deferred_wgrad_queues_the_gemm_and_gives_the_same_grads(sp):
    for rank, r in enumerate(_results(sp)):
        assert r["deferred_queued"] == (2, True), f"rank {rank}: {r['deferred_queued']}"
        _check(r["deferred"], "deferred wgrad", rank)


@SP
@pytest.mark.parametrize("how", ["main_grad", "recompute", "hooks"])
def test_weight_grad_accumulates_into_main_grad(sp, how):
    """Also under recompute and saved-tensor hooks, whose unpacked weight is a new tensor:
    the fused GEMM still finds the parameter's main_grad (not a silent fall-back to .grad)."""
    for rank, r in enumerate(_results(sp)):
        assert r[f"{how}_no_grad"], f"rank {rank}, {how}: .grad set although main_grad exists"
        _check(r[how], f"main_grad accumulation ({how})", rank)


def test_a_weight_with_a_grad_hook_is_not_fused():
    """register_hook hooks see the real weight gradient, which lands in .grad, not main_grad."""
    for rank, r in enumerate(_results(True)):
        hook_err, grad_err, main_grad_touched = r["hooked"]
        assert hook_err < 1e-12 and grad_err < 1e-12, f"rank {rank}: {hook_err}, {grad_err}"
        assert not main_grad_touched, f"rank {rank}: main_grad written behind the hook's back"


@SP
def test_grad_buffer_hook_counts_each_param_once_per_microbatch(sp):
    """Fused accumulation: every parameter counted twice (two microbatches), the bucket
    launched during backward, no .grad left, main_grad = the sum. Deferred: the weights are
    not counted (their bucket waits for finish()), and after run_wgrads + finish the same."""
    for rank, r in enumerate(_results(sp)):
        fused, deferred = dict(r["buffer_defer=False"]), dict(r["buffer_defer=True"])
        assert fused.pop("counts") == [2, 2, 2, 2], f"rank {rank}"
        assert fused.pop("launched_in_backward") is True, f"rank {rank}"
        assert deferred.pop("counts") == [2, 2], f"rank {rank}: only the biases counted"
        assert deferred.pop("launched_in_backward") is False, f"rank {rank}"
        for what, res in (("fused", fused), ("deferred", deferred)):
            assert res.pop("grads_left") == [], f"rank {rank} {what}"
            _check(res, f"GradBuffer {what}", rank, tol=1e-5)


def test_sequence_parallel_saves_only_the_local_input_shard():
    for rank, r in enumerate(_results(True)):
        saved, shard_bytes = r["saved_bytes"]
        assert saved == shard_bytes, f"rank {rank}: saved {saved} bytes, local shard {shard_bytes}"
    for rank, r in enumerate(_results(False)):
        saved, full_bytes = r["saved_bytes"]
        assert saved == full_bytes, f"rank {rank}: saved {saved} bytes, input {full_bytes}"
