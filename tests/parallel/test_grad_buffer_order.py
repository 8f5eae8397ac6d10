"""Gradient buffers (parallel/data_parallel/buffers.py) with the fused weight gradient of
parallel/linear_async.py: every parameter's gradient accumulator gets a defined gradient on the
parameter's device (so CUDA's autograd runs them all on the device thread, in backward order),
bucket reductions start in the model's backward order on every rank whatever each rank's timing,
and a gradient reaching the buffer from a second thread within a step is refused."""

import contextlib
import functools
import threading
import time

import torch

from tests.dist_harness import run_ranks

H, F = 8, 16  # blocks of H -> F -> H


def _model(group, blocks: int = 3) -> torch.nn.Sequential:
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [ColumnParallelLinear(H, F, group), torch.nn.GELU()]
        layers += [RowParallelLinear(F, H, group), torch.nn.LayerNorm(H)]
    model = torch.nn.Sequential(*layers)
    for p in model.parameters():  # the layers leave their weights to params.init_parameters
        torch.nn.init.normal_(p, std=0.5)
    return model


class _Delay(torch.autograd.Function):
    """Identity; its backward sleeps `seconds` (a slow rank at that point of the backward)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def _forward(model, x, delays):
    for i, layer in enumerate(model):
        x = _Delay.apply(layer(x), delays.get(i, 0.0))
    return x


def _reference_param_order(model) -> list[str]:
    """The order in which plain autograd (no buffer, no main_grad) finishes each parameter."""
    order, names = [], {id(p): n for n, p in model.named_parameters()}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[id(q)]))
        for p in model.parameters()
    ]
    model(torch.randn(4, 2, H)).square().sum().backward()
    for h in hooks:
        h.remove()
    return order


def _launch_order(rank, world, zero2: bool):
    import torch.distributed as dist

    from megatron_lite.parallel.data_parallel.buffers import GradBuffer

    single = [dist.new_group([r]) for r in range(world)][rank]  # tp = 1
    want = _reference_param_order(_model(single))
    model = _model(single)
    names = {id(p): n for n, p in model.named_parameters()}
    group = dist.group.WORLD
    buf = GradBuffer(
        list(model.parameters()),
        group,
        shard_group=group,
        bucket_size=H * F,  # about one weight each: 9 buckets
        keep_full_grads=not zero2,
        names=names,
    )
    launched = []
    launch = buf._launch

    def record(b):
        launched.append(buf.buckets.index(b))
        if rank == 1 and len(launched) % 2:  # a slow launch on rank 1
            time.sleep(0.02)
        launch(b)

    buf._launch = record
    # rank 0 is slow early in the backward (the last layers), rank 1 late (the first ones)
    delays = {10: 0.03, 8: 0.03} if rank == 0 else {1: 0.03, 0: 0.03}
    buf.start_step(2)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        _forward(model, torch.randn(4, 2, H), delays).square().sum().backward()
    in_backward = list(launched)
    buf.finish()
    # a bucket starts once its last parameter (in `want`'s order) has its gradient
    last = {i: max(want.index(names[id(p)]) for p in b.params) for i, b in enumerate(buf.buckets)}
    expected = sorted(last, key=last.get)
    return in_backward, launched, expected


def _check_launch_order(zero2: bool):
    results = run_ranks(2, _launch_order, zero2, timeout=60)
    orders = [r[1] for r in results]
    assert orders[0] == orders[1], f"bucket launch order differs across ranks: {orders}"
    for rank, (in_backward, launched, expected) in enumerate(results):
        # ZeRO-0/1: each bucket once, after the last microbatch; ZeRO-2: once per microbatch
        want = expected * 2 if zero2 else expected
        assert in_backward == want, (
            f"rank {rank}: buckets launched during backward in order {in_backward}, the "
            f"model's backward order is {want}"
        )
        assert launched == in_backward, f"rank {rank}: finish() launched more: {launched}"


def test_zero1_buckets_start_in_backward_order_on_every_rank_under_delays():
    _check_launch_order(zero2=False)


def test_zero2_buckets_start_in_backward_order_on_every_rank_under_delays():
    _check_launch_order(zero2=True)


def _accumulator_inputs(rank, world):
    """What reaches each parameter's AccumulateGrad node (seen by a pre-hook registered before
    the buffer's), fused and with deferred wgrads; and a step whose second microbatch's
    backward runs on another thread."""
    import torch.distributed as dist
    from torch.autograd.graph import get_gradient_edge

    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.parallel.data_parallel.buffers import GradBuffer
    from megatron_lite.parallel.linear_async import defer_wgrad, run_wgrads

    group = dist.group.WORLD
    out = {}
    for defer in (False, True):
        model = _model(group, blocks=1)
        seen, accs = {}, []
        for n, p in model.named_parameters():
            acc = get_gradient_edge(p).node
            accs.append(acc)  # kept alive: autograd holds it weakly

            def look(grads, n=n, seen=seen):
                g = grads[0]
                seen[n] = "undefined" if g is None else str(g.device)

            acc.register_prehook(look)
        buf = GradBuffer(list(model.parameters()), group, bucket_size=1 << 20)
        buf.start_step(1)
        queue = []
        with defer_wgrad(model, queue) if defer else contextlib.nullcontext():
            y = model(torch.randn(4, 2, H))
        y.square().sum().backward()
        run_wgrads(queue)
        buf.finish()
        w = model[0].weight
        placeholder = getattr(w, "main_grad_placeholder", None)
        out[f"defer={defer}"] = {
            "seen": seen,
            "devices": {n: str(p.device) for n, p in model.named_parameters()},
            "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
            "placeholder_bytes": placeholder is not None and placeholder.untyped_storage().nbytes(),
            "weight_grad": float(w.main_grad.abs().sum()),
        }

    model = _model(group, blocks=1)
    names = {id(p): n for n, p in model.named_parameters()}
    buf = GradBuffer(list(model.parameters()), group, bucket_size=1 << 20, names=names)
    errors = []

    def backward():
        try:
            model(torch.randn(4, 2, H)).square().sum().backward()
        except RuntimeError as e:
            errors.append(str(e))

    def on_thread(name):
        t = threading.Thread(target=backward, name=name)
        t.start()
        t.join()

    STATS.start_step(5)
    buf.start_step(2)
    backward()  # microbatch 0 on the main thread
    on_thread("second")  # microbatch 1 from another thread: refused
    out["refused"] = list(errors)
    errors.clear()
    buf.start_step(1)  # a new step may use another thread, once
    on_thread("next-step")
    buf.finish()
    out["next_step_errors"] = list(errors)
    return out


@functools.cache
def _accumulator_results():
    return run_ranks(1, _accumulator_inputs, timeout=60)[0]


def test_every_gradient_accumulator_gets_a_defined_gradient_on_the_parameter_device():
    """CUDA's autograd runs an accumulator on its input's device thread, or on the CPU thread
    when the input is undefined: the fused (and the deferred) weight gradient must not be
    None, yet no weight-sized tensor is made for it and nothing is left in .grad."""
    for case, r in _accumulator_results().items():
        if not case.startswith("defer="):
            continue
        assert r["seen"] == r["devices"], f"{case}: accumulator inputs {r['seen']}"
        assert r["grads_left"] == [], f"{case}: .grad stored for {r['grads_left']}"
        assert r["placeholder_bytes"] == 4, f"{case}: placeholder {r['placeholder_bytes']} B"
        assert r["weight_grad"] > 0, f"{case}: the weight gradient never reached main_grad"


def test_a_gradient_from_a_second_thread_in_one_step_is_refused():
    r = _accumulator_results()
    (message,) = r["refused"]
    for part in ("rank 0 step 5", "thread 'second'", "parameter 3.", "MainThread", "Fix:"):
        assert part in message, f"{part!r} missing from: {message}"
    assert r["next_step_errors"] == [], r["next_step_errors"]
