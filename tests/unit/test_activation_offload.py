"""Activation offload's mechanism on plain torch layers (parallel/activation_offload.py): the
gradients are bit for bit those without it, the bytes it moves are the bytes an independent
saved-tensor count finds, weights and small tensors stay, the in-flight limit holds, recomputed
regions are left alone, and the pipeline rule reads the schedule table."""

import pytest
import torch
from torch import nn

from megatron_lite.parallel import recompute as rc
from megatron_lite.parallel.activation_offload import OFFLOAD_MODULES, ActivationOffloader
from megatron_lite.parallel.random import RNGStatesTracker
from megatron_lite.pipeline.engine import backward_follows
from megatron_lite.pipeline.schedules import get_schedule

H = 16


class ToyLayer(nn.Module):
    """norm -> mlp (optionally recomputed), residual; parts named as a transformer layer's."""

    def __init__(self, recomputed: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        self.recomputed, self.tracker = recomputed, RNGStatesTracker()

    def offload_parts(self):
        return {"attn_norm": self.norm, "mlp": self.mlp}

    def forward(self, x):
        h = self.norm(x)
        if self.recomputed:
            return x + rc.recompute(self.mlp, h, tracker=self.tracker)
        return x + self.mlp(h)


def layers(n=3, recomputed=False):
    torch.manual_seed(0)
    return nn.ModuleList(ToyLayer(recomputed) for _ in range(n))


def run(stack, x):
    """Loss and the gradients (of the weights and the input) of one forward and backward."""
    x = x.clone().requires_grad_()
    for layer in stack:
        x2 = layer(x if layer is stack[0] else x2)  # noqa: F821
    loss = (x2.double() ** 2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in stack.parameters()] + [x.grad]


def counted_bytes(stack, names, min_bytes, x):
    """Independent reference: bytes of the distinct tensor views the named parts save (plain
    saved_tensors_hooks, no copies), parameters and smaller tensors left out."""
    total, seen = [0], set()
    weights = {p.untyped_storage().data_ptr() for p in stack.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() in weights or rc.in_region():
            return t  # a weight (or a view of one: Linear saves weight.t() for 3-d inputs)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        nbytes = t.numel() * t.element_size()
        if nbytes >= max(min_bytes, 1) and key not in seen:
            seen.add(key)
            total[0] += nbytes
        return t

    handles, ctx = [], []
    for layer in stack:
        for name, m in layer.offload_parts().items():
            if name in names:

                def pre(*_):
                    ctx.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
                    ctx[-1].__enter__()

                def post(*_):
                    ctx.pop().__exit__(None, None, None)
                    seen.clear()

                handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    run(stack, x)
    for h in handles:
        h.remove()
    return total[0]


X = torch.randn(8, 2, H)


@pytest.mark.parametrize("names", [["mlp"], ["attn_norm", "mlp"]])
def test_gradients_bitwise_and_bytes_match_an_independent_count(names):
    ref_loss, ref_grads = run(layers(), X)
    stack = layers()
    off = ActivationOffloader(names, min_bytes=0, inflight=2)
    off.attach([list(stack)])
    loss, grads = run(stack, X)
    assert torch.equal(loss, ref_loss)
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"gradient {i} differs with offload of {names}"
    expected = counted_bytes(layers(), names, 0, X)
    st = off.stats
    assert expected > 0 and st.offloaded_bytes == expected, (st, expected)
    assert st.reloaded_bytes == expected and st.host_bytes == 0  # all came back, none held
    assert st.peak_host_bytes == expected  # 3 layers' copies alive at the end of the forward
    assert st.max_in_flight == 2 and st.late_reloads == 0


def test_weights_and_small_tensors_stay():
    # Linear(H, 4H) saves its input [8, 2, 16] fp32 = 1 KiB and GELU its [8, 2, 64] = 4 KiB
    stack = layers(1)
    off = ActivationOffloader(["mlp"], min_bytes=2048)
    off.attach([list(stack)])
    run(stack, X)
    big = counted_bytes(layers(1), ["mlp"], 2048, X)
    assert off.stats.offloaded_bytes == big == 2 * 4096  # GELU's input, fc2's input: weights stay


def test_inflight_limit_one():
    stack = layers()
    off = ActivationOffloader(["attn_norm", "mlp"], min_bytes=0, inflight=1)
    off.attach([list(stack)])
    run(stack, X)
    assert off.stats.max_in_flight == 1


def test_recomputed_region_is_not_offloaded():
    """The mlp runs inside a checkpoint: nothing of it is saved, so nothing is offloaded; the
    norm still is; gradients equal the plain run's."""
    ref_loss, ref_grads = run(layers(recomputed=True), X)
    stack = layers(recomputed=True)
    off = ActivationOffloader(["attn_norm", "mlp"], min_bytes=0)
    off.attach([list(stack)])
    loss, grads = run(stack, X)
    assert torch.equal(loss, ref_loss) and all(map(torch.equal, grads, ref_grads))
    norm_only = counted_bytes(layers(), ["attn_norm"], 0, X)
    assert off.stats.offloaded_bytes == norm_only > 0


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model.activation_offload=.*'norms'.*attn_norm"):
        ActivationOffloader(["norms"])
    assert "core_attn" in OFFLOAD_MODULES and "attn_proj" in OFFLOAD_MODULES


def test_backward_follows_reads_the_table():
    """1F1B on pp=2, 4 microbatches: the last stage runs each backward right after its forward,
    the first stage never (its warmup forward is one ahead); no pipelining: every one."""
    assert backward_follows(get_schedule(2, 1, 4)) == {(m, 0) for m in range(4)}
    assert backward_follows(get_schedule(2, 0, 4)) == set()
    assert backward_follows(get_schedule(1, 0, 3)) == {(m, 0) for m in range(3)}


def test_memory_tracker_sees_host_bytes_apart():
    """Under the memory tracker the host copies are host bytes, not device ones: after the
    forward the device activations are lower by exactly the bytes on the host, the tracked
    host peak is the offloader's, and nothing is left on the host after the backward."""
    from megatron_lite.training.memory_tracker import MemoryTracker

    def forward_backward(offload: bool):
        stack = layers(4)
        with MemoryTracker("cpu") as tracker:
            off = ActivationOffloader(
                ["mlp"],
                min_bytes=0,
                inflight=1,
                on_host=tracker.offloaded_to_host,
                host_scope=tracker.host_allocations,
            )
            if offload:
                off.attach([list(stack)])
            y = X.clone().requires_grad_()
            for layer in stack:
                y = layer(y)
            after_forward = tracker.current["activations"], tracker.host_bytes
            (y.double() ** 2).sum().backward()
        return tracker, off.stats, after_forward

    _, _, (plain, _) = forward_backward(False)
    tracker, st, (device, host) = forward_backward(True)
    assert host == st.peak_host_bytes == tracker.host_peak == 4 * 9216  # fc1, GELU, fc2 inputs
    assert plain - device == host, (plain, device, host)
    assert tracker.host_bytes == 0 and st.host_bytes == 0


def _validate(*overrides: str):
    from megatron_lite.config import load_config
    from megatron_lite.validation import validate

    return validate(
        load_config(None, ["data.mock=true", "model.vocab_size=512", *overrides]), 1, warn=False
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.activation_offload=[norms]"], r"model.activation_offload=\['norms'\].*attn_norm"),
        (["model.activation_offload=[mlp,mlp]"], r"model.activation_offload=.*twice"),
        (["model.activation_offload=[moe_experts]"], r"model.activation_offload=.*no MoE layer"),
        (["model.activation_offload_inflight=0"], r"model.activation_offload_inflight=0.*>= 1"),
        (["model.activation_offload_min_bytes=-1"], r"activation_offload_min_bytes=-1.*>= 0"),
        (
            ["model.activation_offload=[mlp]", "model.compile=true"],
            r"model.activation_offload=.*model.compile=false",
        ),
    ],
)
def test_bad_config_is_a_clear_error(overrides, message):
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _validate(*overrides)


def test_valid_config_passes():
    cfg = _validate("model.activation_offload=[attn_norm,core_attn,attn_proj,mlp_norm,mlp]")
    assert cfg.model.activation_offload[-1] == "mlp"


def test_planner_counts_from_the_table():
    """pp=2 1F1B, 4 microbatches, 2 layers a stage: stage 0 offloads both layers of every
    microbatch and holds 2 microbatches after its warmup; stage 1 keeps each last layer and
    holds one layer; copies of 64 MB at 32 GB/s (2 ms) hide behind a 3 ms forward, not 1 ms."""
    from megatron_lite.plan.activation_offload import offload_plan, table_counts

    assert table_counts(get_schedule(2, 0, 4), [2]) == (8, 4)
    assert table_counts(get_schedule(2, 1, 4), [2]) == (4, 1)
    plan = offload_plan(64e6, 8, 4, 3e-3, 32.0)
    assert plan.pcie_bytes_per_step == 2 * 8 * 64e6 and plan.host_peak_bytes == 4 * 64e6
    assert plan.copy_s == pytest.approx(2e-3) and plan.hidden
    assert not offload_plan(64e6, 8, 4, 1e-3, 32.0).hidden


def test_fake_tensors_are_offloaded_as_real_ones():
    """A dry run (fake tensors) moves the bytes a real run moves."""
    from megatron_lite.parallel.fake import FakeTensorMode

    stack = layers()
    off = ActivationOffloader(["attn_norm", "mlp"], min_bytes=0)
    off.attach([list(stack)])
    with FakeTensorMode(allow_non_fake_inputs=True):
        run(stack, torch.empty(8, 2, H))
    expected = counted_bytes(layers(), ["attn_norm", "mlp"], 0, X)
    assert off.stats.offloaded_bytes == off.stats.reloaded_bytes == expected > 0
