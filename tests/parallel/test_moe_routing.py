"""DeepSeek-V3-style routing on several ranks: loss parity against one rank for sigmoid scores
with the aux-loss-free expert bias, the sequence-wise aux loss and group-limited routing (one
model with all three, 6 steps, fp32), the bias trajectory equal on every layout, and the
all-to-all destinations of group-limited routing counted on a real ep=4 dispatch."""

import functools

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import (
    SHORT,
    SHORT_STEPS,
    TINY,
    _train,
    assert_parity,
    max_rel_diff,
    structured_dataset,
    train_records,
)

NUM_LAYERS = 4  # parity.TINY's
ROUTING = [
    "model.arch=llama",
    "model.num_experts=8",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_topk_scaling_factor=2.5",
    "model.moe_router_enable_expert_bias=true",
    # 0.01 rather than DeepSeek-V3's 1e-3: the tiny router's scores differ by ~1e-2, so the
    # bias decides routing from step 2 on and a wrong count shows in the losses too
    "model.moe_router_bias_update_rate=0.01",
    "model.moe_aux_loss_type=seq",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_router_num_groups=4",
    "model.moe_router_group_topk=2",
]
# the layouts that split what the router reduces: experts over EP (the bias update reads the
# counts of every EP rank's tokens), sequences over SP and CP (the per-sequence statistics of
# the seq loss are gathered), the optimizer state (ZeRO-1) and the parameters (ZeRO-3, where
# the bias is an FSDP2 shard updated in place)
LAYOUTS = {
    "ep2_zero1": (2, ["parallel.ep=2", "parallel.zero_stage=1"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep2_tp2_sp": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2_cp2": (2, ["parallel.ep=2", "parallel.cp=2"]),
    "ep2_zero3": (2, ["parallel.ep=2", "parallel.zero_stage=3"]),
}
LAYER_BIAS = tuple(
    f"moe/layer_{i}/expert_bias_{end}" for i in range(NUM_LAYERS) for end in ("min", "max")
)
METRICS = (
    "loss",
    "grad_norm",
    "aux_loss",
    "tokens_per_expert_min",
    "tokens_per_expert_max",
    "expert_bias_min",
    "expert_bias_max",
    "load_max_mean_ratio",
    *LAYER_BIAS,
)


@functools.cache
def reference_records() -> list[dict]:
    """One rank, ep=1, all experts local (shared by every layout: never modify it)."""
    return train_records(1, [*ROUTING, *SHORT], METRICS)


@pytest.mark.parity
@pytest.mark.parametrize("layout", LAYOUTS)
def test_routing_loss_and_bias_parity(layout):
    world, parallel = LAYOUTS[layout]
    ref = reference_records()
    got = train_records(world, [*ROUTING, *SHORT, *parallel], METRICS)
    losses = [r["loss"] for r in ref]
    assert losses[-1] < losses[0] - 0.1, f"reference loss did not fall: {losses}"
    assert_parity(got, ref, f"routing {layout}")
    aux = max_rel_diff([r["aux_loss"] for r in got], [r["aux_loss"] for r in ref])
    print(f"PARITY routing {layout}: seq aux loss {aux:.2e}")
    assert aux < 1e-4, f"{layout}: sequence aux loss differs by {aux:.2e} (relative)"
    # sign updates of exact integer counts: the same fp32 bias on every layout, bit for bit
    for key in ("expert_bias_min", "expert_bias_max"):
        assert [r[key] for r in got] == [r[key] for r in ref], f"{layout}: {key} trajectory"
    last, ref_last = got[-1], ref[-1]
    assert {k: last[k] for k in LAYER_BIAS} == {k: ref_last[k] for k in LAYER_BIAS}
    assert max(r["expert_bias_max"] for r in ref) >= 0.02, "the bias should have moved"
    for key in ("tokens_per_expert_min", "tokens_per_expert_max"):
        assert [r[key] for r in got] == [r[key] for r in ref], f"{layout}: {key}"


def test_expert_bias_resumes_from_checkpoint_on_another_layout(tmp_path):
    """Save after 3 steps on ep2 ZeRO-3 (the bias is an FSDP2 shard), resume on ep4 ZeRO-0 for
    the rest: the bias picks up where it was (trajectory bit for bit the unbroken run's)."""
    half = SHORT_STEPS // 2
    common = [*TINY, f"data.paths=[{structured_dataset()}]", *ROUTING]
    schedule = [f"train.lr_decay_steps={SHORT_STEPS}", "train.save_interval=100"]
    first = [f"train.steps={half}", "parallel.ep=2", "parallel.zero_stage=3", *schedule]
    run_ranks(2, _train, [*common, *first], str(tmp_path), None, METRICS, timeout=120)
    rest = [*SHORT, "parallel.ep=4", *schedule]
    got = run_ranks(4, _train, [*common, *rest], str(tmp_path), None, METRICS, timeout=120)[0]
    ref = reference_records()[half:]
    assert len(got) == len(ref), f"resumed run trained {len(got)} steps, want {len(ref)}"
    for key in ("expert_bias_min", "expert_bias_max"):
        assert [r[key] for r in got] == [r[key] for r in ref], f"resumed {key} trajectory"
    assert ref[0]["expert_bias_max"] > 0, "the saved bias should not be zero"
    diff = max_rel_diff([r["loss"] for r in got], [r["loss"] for r in ref])
    assert diff < 1e-4, f"resumed losses differ by {diff:.2e} (relative)"


def _biases_per_step(rank, world, overrides, out_dir):
    """Train with the router weight's gradient NaN at step 2 (0-based); each step's
    (skipped, the expert biases after it)."""
    from megatron_lite.moe.layer import moe_layers
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    routers = [layer.router for layer in moe_layers(trainer.chunks)]
    routers[0].weight.register_hook(lambda g: g * float("nan") if trainer.step == 2 else g)
    out = []
    while trainer.step < cfg.train.steps:
        record = trainer.train_step()
        out.append((record.get("skipped", False), [r.expert_bias.tolist() for r in routers]))
    return out


def test_skipped_step_leaves_the_expert_bias(tmp_path):
    """A step the non-finite guard skips updates neither the weights nor the expert bias; the
    steps around it do update the bias."""
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, *ROUTING, "train.steps=4", "train.skip_nonfinite_steps=1"]
    steps = run_ranks(1, _biases_per_step, args, str(tmp_path), timeout=120)[0]
    assert [skipped for skipped, _ in steps] == [False, False, True, False]
    biases = [b for _, b in steps]
    assert biases[2] == biases[1], "the skipped step changed the expert bias"
    assert biases[1] != biases[0] and biases[3] != biases[2], "a finite step must update it"


# ---------------------------------------------------------------- metrics of layers on two stages
def _stage_metrics(rank, world):
    """Rank r holds MoE layer 2r of a 3-layer model (layer 1 dense), routes 2 microbatches,
    then moe_metrics with the bias update: (metrics, each forward's stats, bias before/after)."""
    import torch
    import torch.distributed as dist

    from megatron_lite.moe import MoELayer, moe_metrics
    from megatron_lite.moe.router import RouterOptions

    torch.manual_seed(rank)
    options = RouterOptions(score_function="sigmoid", enable_expert_bias=True)
    layer = MoELayer(
        16, 8, 4, 2, layer_number=2 * rank, router_options=options, capacity_factor=0.8
    )
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]) * (rank + 1))
    before = layer.router.expert_bias.tolist()
    for _ in range(2):
        layer(torch.randn(6, 2, 16))  # [s, b, h]
    stats = [st.tolist() for st, _ in layer.stats]
    metrics = moe_metrics(
        [layer], 3, 4, True, group=dist.group.WORLD, expert_bias=True, update_bias=True
    )
    return metrics, stats, before, layer.router.expert_bias.tolist()


def test_moe_metrics_per_layer_over_stages_and_bias_update():
    """Per-layer figures of layers held on different ranks, from one all-reduce: load max/mean
    and dropped tokens from each layer's own counts, the bias range of each, and each layer's
    bias moved by rate · sign(mean − load) of its counts (default rate 1e-3)."""
    import torch

    results = run_ranks(2, _stage_metrics, timeout=60)
    metrics = results[0][0]
    assert all(r[0] == metrics for r in results), "every rank reports the same figures"
    assert not any(k.startswith("moe/layer_1/") for k in metrics), "layer 1 is dense"
    for rank, (_, stats, before, after) in enumerate(results):
        i = 2 * rank
        counts = [sum(st[e] for st in stats) for e in range(4)]
        dropped = sum(st[6] for st in stats)
        assert dropped > 0, "capacity 0.8 should drop some assignments"
        ratio = max(counts) / (sum(counts) / 4)
        assert abs(metrics[f"moe/layer_{i}/load_max_mean_ratio"] - ratio) < 1e-12
        assert metrics[f"moe/layer_{i}/dropped_tokens"] == dropped
        assert metrics[f"moe/layer_{i}/expert_bias_min"] == min(before)
        assert metrics[f"moe/layer_{i}/expert_bias_max"] == max(before)
        mean = sum(counts) / 4
        want = [
            torch.tensor(b, dtype=torch.float32).item()
            + (1e-3 if c < mean else -1e-3 if c > mean else 0.0)
            for b, c in zip(before, counts, strict=True)
        ]
        assert max(abs(a - w) for a, w in zip(after, want, strict=True)) < 1e-7, (after, want)
        assert after != before
    all_before = [b for r in results for b in r[2]]
    assert metrics["expert_bias_min"] == min(all_before)
    assert metrics["expert_bias_max"] == max(all_before)
    assert metrics["dropped_tokens"] == sum(st[6] for r in results for st in r[1])


# ---------------------------------------------------------------- destinations per token
E, K, H, EP = 8, 4, 16, 4


def _destinations(rank, world, num_groups, group_topk):
    """One MoE layer on `world` EP ranks with a skewed router: for each local token, the
    distinct EP ranks its dispatched rows went to (read from the real all-to-all's send
    splits and the rows' source tokens)."""
    import torch
    import torch.distributed as dist

    from megatron_lite.moe import MoELayer
    from megatron_lite.moe.router import RouterOptions

    torch.manual_seed(0)  # the same layer weights on every rank
    options = RouterOptions(
        score_function="sigmoid",
        enable_expert_bias=True,
        num_groups=num_groups,
        group_topk=group_topk,
    )
    layer = MoELayer(H, 8, E, K, ep_group=dist.group.WORLD, router_options=options)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
        for p in layer.experts.parameters():
            p.normal_(0.0, 0.1)
        layer.router.expert_bias.normal_(0.0, 0.5)  # a trained-looking bias
    seen = []
    dispatch = layer.dispatcher.dispatch

    def recording(*args, **kwargs):
        out = dispatch(*args, **kwargs)
        seen.append(out[2])
        return out

    layer.dispatcher.dispatch = recording
    torch.manual_seed(1 + rank)  # each rank's own tokens
    x = torch.randn(32, 2, H, requires_grad=True)  # [s, b, h]
    layer(x).sum().backward()  # the combine's all-to-all runs too
    handle = seen[0]
    dest = torch.repeat_interleave(torch.arange(world), torch.tensor(handle.send_splits))
    per_token = [set() for _ in range(handle.num_tokens)]
    for t, r in zip(handle.token_ids.tolist(), dest.tolist(), strict=True):
        per_token[t].add(r)
    return [len(s) for s in per_token]


def test_group_limited_routing_reaches_at_most_group_topk_ep_ranks():
    """Groups = EP ranks (contiguous expert blocks): every token's rows go to at most
    group_topk ranks; without the limit the same router sends tokens to more."""
    limited = [n for counts in run_ranks(EP, _destinations, EP, 2, timeout=60) for n in counts]
    free = [n for counts in run_ranks(EP, _destinations, None, None, timeout=60) for n in counts]
    print(
        f"DESTINATIONS ep={EP} k={K}: group_topk=2 max {max(limited)} mean "
        f"{sum(limited) / len(limited):.2f}; unlimited max {max(free)}"
    )
    assert min(limited) >= 1 and max(limited) <= 2, f"limited: {sorted(set(limited))}"
    assert max(free) > 2, "without the limit some token should reach more than 2 EP ranks"


def test_expert_bias_keeps_updating_after_init_from(tmp_path):
    """A model-only checkpoint (what hf-to-dcp writes; a converted DeepSeek-V3 carries its
    e_score_correction_bias as the routers' expert_bias) loads through train.init_from with its
    bias, and training moves that bias by model.moe_router_bias_update_rate from there."""
    import torch

    from tools.convert_checkpoint import read_model, write_model

    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, *ROUTING]
    first = [*args, "train.steps=1", "train.save_interval=1"]
    run_ranks(1, _train, first, str(tmp_path / "a"), None, ("loss",), timeout=120)
    meta, tensors = read_model(str(tmp_path / "a" / "checkpoints"))
    g = torch.Generator().manual_seed(0)
    loaded = {}
    for name in [n for n in tensors if n.endswith("router.expert_bias")]:
        tensors[name] = loaded[name] = torch.randn(tensors[name].shape, generator=g) * 0.1
    assert len(loaded) == NUM_LAYERS
    write_model(str(tmp_path / "init"), tensors, meta["config"]["model"], source="test")
    second = [*args, "train.steps=2", f"train.init_from={tmp_path / 'init'}"]
    steps = run_ranks(1, _biases_per_step, second, str(tmp_path / "b"), timeout=120)[0]
    rate = 0.01  # ROUTING's model.moe_router_bias_update_rate
    start = [b.tolist() for b in loaded.values()]  # the layers in order
    for (_, after), before in zip(steps, [start, steps[0][1]], strict=True):
        for layer_after, layer_before in zip(after, before, strict=True):
            moved = torch.tensor(layer_after) - torch.tensor(layer_before)
            steps_of_rate = moved / rate  # -1, 0 or +1 each (the sign of mean load - load)
            assert torch.allclose(steps_of_rate, steps_of_rate.round(), atol=1e-4), moved
            assert steps_of_rate.round().abs().max() == 1, "the bias did not move"
