"""ZeRO-3 through torch FSDP2 (parallel.zero_stage=3): the losses of a single rank (fp32, 6
steps) on DP, HSDP, TP+SP, pipeline chunks with tied embeddings across stages and experts;
bf16 tracks the bf16 single rank; checkpoints resume across stages and dp sizes; the model
states per rank shrink to about 1/N; one reduce-scatter per unit per step under gradient
accumulation; what stage 3 does not compose with is refused up front."""

import pytest

from megatron_lite.config import ConfigError
from tests.dist_harness import run_ranks
from tests.parallel.parity import (
    SHORT,
    TINY,
    assert_parity,
    max_rel_diff,
    reference_losses,
    train_losses,
)
from tests.parallel.test_checkpoint import AT, SAVE, STEPS, ckpt, losses, train

LLAMA = ("model.arch=llama",)  # tied embeddings
MOE = ("model.arch=llama", "model.num_experts=4", "model.moe_router_topk=2")
Z3 = "parallel.zero_stage=3"
PER_MB = "parallel.zero3_grad_reduce=microbatch"
ZBV = ("parallel.pipeline_schedule=zb-v", "parallel.vpp=2")
# cp2×dp2 also matches (7e-8) but is left out to keep this file fast: FSDP2 sees CP only as
# the membership of the dp×cp group, which the other layouts exercise
LAYOUTS = {
    "zero3_dp2_keep_gathered": (2, LLAMA, [Z3, "parallel.reshard_after_forward=false"]),
    "zero3_tp2_sp_dp2": (4, LLAMA, [Z3, "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "zero3_pp2_vpp2_dp2": (4, LLAMA, [Z3, "parallel.pp=2", "parallel.vpp=2"]),
    "zero3_ep2_dp4": (4, MOE, [Z3, "parallel.ep=2"]),  # experts sharded over edp = 2
    "zero3_dp4_shard2": (4, LLAMA, [Z3, "parallel.dp_shard=2"]),
    # reduce-scatter every microbatch (M = 2 per rank here), the fp32 shards accumulate
    "zero3_dp2_per_microbatch": (2, LLAMA, [Z3, PER_MB]),
    "zero3_pp2_dp2_per_microbatch": (4, LLAMA, [Z3, PER_MB, "parallel.pp=2"]),  # 1F1B
    "zero3_pp2_dp2_zb_per_microbatch": (4, LLAMA, [Z3, PER_MB, "parallel.pp=2", *ZBV]),
}  # fmt: skip


SLOW = ("zero3_ep2_dp4", "zero3_dp4_shard2", "zero3_pp2_dp2_per_microbatch",
        "zero3_pp2_dp2_zb_per_microbatch")  # fmt: skip


# MoE under ZeRO-3 stays in the suite through test_moe's shared_ep2_zero3 and test_muon's;
# this one in the slow tier (the suite's budget)
@pytest.mark.parity
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS],
)
def test_zero3_loss_parity(layout, tmp_path):
    world, model, overrides = LAYOUTS[layout]
    model = (*model, *SHORT)
    ref = reference_losses(model)
    got = train_losses(world, [*model, *overrides], str(tmp_path))
    assert_parity(got, ref, layout)


def test_zero3_bf16_tracks_the_bf16_single_rank(tmp_path):
    """bf16 gathered weights over fp32 sharded masters, fp32 reduction: the same arithmetic
    as the bf16 single rank (measured: equal), so well inside the bf16-vs-fp32 band."""
    fp32 = reference_losses((*LLAMA, *SHORT))
    bf16 = reference_losses((*LLAMA, *SHORT, "train.precision=bf16"))
    band = max_rel_diff(bf16, fp32)
    got = train_losses(2, [*LLAMA, *SHORT, "train.precision=bf16", Z3], str(tmp_path))
    diff = max_rel_diff(got, bf16)
    print(f"BF16 zero3 dp2 vs bf16 one rank: {diff:.2e} (bf16 vs fp32: {band:.2e})")
    assert diff < 0.1 * band, f"zero3: {diff:.2e} not 10x tighter than bf16 vs fp32 {band:.2e}"


@pytest.mark.slow  # (the suite's budget)
@pytest.mark.parity
def test_zero3_per_microbatch_bf16_tracks_the_bf16_single_rank(tmp_path):
    """Per-microbatch reduce-scatters in fp32, summed into the fp32 shards: the bf16 single
    rank's sums (its fp32 main gradients) within the same 10% of the bf16-vs-fp32 band as the
    once-per-step accumulation (test above; measured: equal, on microbatches of the reference's
    size; at micro-batch 1 against its 2 the GEMMs' bf16 rounding differs, 0.3x the band)."""
    fp32 = reference_losses((*LLAMA, *SHORT))
    bf16 = reference_losses((*LLAMA, *SHORT, "train.precision=bf16"))
    band = max_rel_diff(bf16, fp32)
    args = [*LLAMA, *SHORT, "train.precision=bf16", Z3, PER_MB]
    got = train_losses(2, args, str(tmp_path))  # m = 2 microbatches of the reference's size
    diff = max_rel_diff(got, bf16)
    print(f"BF16 zero3 per-microbatch dp2 vs bf16 one rank: {diff:.2e} (band {band:.2e})")
    assert diff < 0.1 * band, f"per-microbatch: {diff:.2e} not 10x tighter than {band:.2e}"


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_zero3_zero_bubble_bf16_accumulates_like_the_interleaved_schedule(tmp_path):
    """zb-v's W writes bf16 weight gradients after FSDP2's hook; each joins FSDP2's fp32
    accumulator as a backward's would (measured: the interleaved schedule's losses exactly;
    summed in bf16 between Ws instead they drifted 0.2x the bf16-vs-fp32 band)."""
    fp32 = reference_losses((*LLAMA, *SHORT))
    bf16 = reference_losses((*LLAMA, *SHORT, "train.precision=bf16"))
    band = max_rel_diff(bf16, fp32)
    layout = [*LLAMA, *SHORT, "train.precision=bf16", Z3, "parallel.pp=2", "parallel.vpp=2"]
    layout += ["train.micro_batch_size=1"]  # m = 4 per rank: Ws follow each other
    interleaved = train_losses(4, layout, str(tmp_path / "interleaved"))
    zb_v = train_losses(4, [*layout, "parallel.pipeline_schedule=zb-v"], str(tmp_path / "zb"))
    diff = max_rel_diff(zb_v, interleaved)
    print(f"BF16 zero3 zb-v vs interleaved: {diff:.2e} (bf16 vs fp32: {band:.2e})")
    assert diff < 0.02 * band, f"zb-v: {diff:.2e} off the interleaved schedule (band {band:.2e})"


@pytest.mark.slow  # 23 s (the suite's budget); test_checkpoint's resharded resumes stay
def test_resume_across_stages_and_dp_sizes(tmp_path):
    """Stage 1 dp2 saves at step AT -> stage 3 dp4 resumes, and stage 3 dp4 saves -> stage 1
    dp2 resumes: each continues its straight run within 1e-5 (and the two straight runs, and
    the single rank, agree)."""
    stage1, stage3 = [*LLAMA, "parallel.zero_stage=1"], [*LLAMA, Z3]
    one = losses(train(2, [*stage1, *SAVE], tmp_path / "s1")[0])  # straight; saves at AT, STEPS
    three = losses(train(4, [*stage3, *SAVE], tmp_path / "s3")[0])
    assert max_rel_diff(three, one) < 1e-5, f"zero3 dp4 vs zero1 dp2 straight: {three} {one}"
    one_rank = reference_losses((*LLAMA, f"train.steps={STEPS}"))
    assert max_rel_diff(three, one_rank) < 1e-5, "zero3 dp4 vs one rank"
    to3 = train(4, [*stage3, ckpt(tmp_path / "s1"), f"train.steps={STEPS}"], tmp_path / "s1_to_s3")[
        0
    ]
    to1 = train(2, [*stage1, ckpt(tmp_path / "s3"), f"train.steps={STEPS}"], tmp_path / "s3_to_s1")[
        0
    ]
    for name, got in (("zero1 dp2 -> zero3 dp4", to3), ("zero3 dp4 -> zero1 dp2", to1)):
        assert [s for s, _, _ in got] == list(range(AT, STEPS)), f"{name}: not continued at AT"
        diff = max_rel_diff(losses(got), one[AT:])
        print(f"RESUME {name}: max rel diff {diff:.2e}")
        assert diff < 1e-5, f"{name}: resumed losses differ by {diff:.2e}"


def _model_state_bytes(trainer) -> dict[str, int]:
    """Bytes per rank of weights, grads and optimizer states: unique storages actually
    allocated (a DTensor counts its local shard's storage, FSDP2's padding included)."""
    import torch

    seen, out = set(), {"weights": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        if t is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            out[kind] += s.nbytes()

    for p in trainer.params:
        add("weights", p)
        add("grads", getattr(p, "main_grad", None))
        add("grads", p.grad)
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                add("optimizer", v)
    for pc in getattr(trainer.optimizer, "pieces", []):  # ZeRO 0-2: masters (aliased or not)
        add("optimizer", pc.master)
    return out


def _memory_and_reductions(rank, world, overrides, out_dir):
    """Per stage: model-state bytes after one step, and the reduce-scatters of that step."""
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    calls = []
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else None
    name = name or "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counting(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    setattr(dist, name, counting)
    out = {}
    for stage in (0, 3):
        args = ["train.out_dir=" + f"{out_dir}/{stage}", *overrides, f"parallel.zero_stage={stage}"]
        cfg, dataset, vocab = prepare(args, world_size=world)
        mesh = ParallelMesh(RankLayout(world))
        trainer = Trainer(cfg, mesh, dataset, vocab)
        calls.clear()
        trainer.train()
        out[stage] = (_model_state_bytes(trainer), len(calls))
    return out


def test_zero3_model_states_shrink_and_reduce_once_per_step(tmp_path):
    """dp=4, 4 microbatches per rank: stage 3's model states are <= 0.3x stage 0's, and each
    FSDP unit (4 layers + the chunk root) reduce-scatters once per step, not per microbatch."""
    from tests.parallel.parity import structured_dataset

    args = [*TINY, f"data.paths=[{structured_dataset()}]", *LLAMA]
    args += ["train.steps=1", "train.global_batch_size=32"]
    results = run_ranks(4, _memory_and_reductions, args, str(tmp_path), timeout=120)
    for rank, out in enumerate(results):
        (zero0, _), (zero3, reductions) = out[0], out[3]
        ratio = sum(zero3.values()) / sum(zero0.values())
        print(f"MEMORY rank {rank}: zero0 {zero0} zero3 {zero3} ratio {ratio:.3f}")
        assert ratio <= 0.3, f"rank {rank}: stage 3 keeps {ratio:.2f}x the model states"
        assert reductions == 5, f"rank {rank}: {reductions} reduce-scatters in one step, not 5"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.optimizer_offload=cpu"], "train.optimizer_offload='cpu'"),
        (["model.linear_backend=te"], "model.linear_backend='te'"),
    ],
)
def test_zero3_validation(overrides, key):
    from megatron_lite.config import load_config
    from megatron_lite.validation import validate

    cfg = load_config(None, [*TINY, "data.mock=true", Z3, *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert key in str(e.value) and "zero_stage" in str(e.value) and "Fix:" in str(e.value)


def _group_after_hybrid_experts(rank, world, overrides, out_dir):
    """Build a ZeRO-3 HSDP trainer, then create one more group on every rank and use it: that
    works only if every rank created the same groups before (else group names diverge)."""
    import torch
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    Trainer(cfg, ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp)), dataset, vocab)
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group(list(range(world))))
    return t.item()


def test_hybrid_zero3_creates_the_same_groups_on_stages_without_experts(tmp_path):
    """MoE only in layer 0 (pipeline stage 1 has no expert) under ZeRO-3 with dp_shard: the
    expert groups are created on every rank, so groups created later still match."""
    overrides = [*TINY, "data.mock=true", *MOE, "model.moe_layer_freq=4", Z3, "parallel.pp=2",
                 "parallel.dp_shard=1", "train.global_batch_size=8"]  # fmt: skip
    got = run_ranks(4, _group_after_hybrid_experts, overrides, str(tmp_path), timeout=60)
    assert got == [4.0] * 4


@pytest.mark.parametrize(
    "schedule, units",
    [
        # rank 0 of pp2: zb-h1 holds 2 layers + its chunk root; zb-v two chunks of 1 layer + root
        (["parallel.pipeline_schedule=zb-h1"], 3),
        (["parallel.pipeline_schedule=zb-v", "parallel.vpp=2"], 4),
    ],
)
def test_zero3_zero_bubble_reduces_each_unit_once_per_step(schedule, units):
    """Zero-bubble schedules compute the linear weight gradients in W, after FSDP2's
    post-backward hook: each FSDP unit still reduce-scatters once a step (after its chunk's
    last W), not once per microbatch (4 here: 4x the count)."""
    from tests.parallel.parity import train_records

    overrides = [*LLAMA, Z3, "parallel.pp=2", *schedule, "train.steps=2"]
    overrides += ["train.micro_batch_size=1"]  # m = 4 microbatches per dp rank
    records = train_records(4, overrides, ["comm_calls/reduce_scatter_fsdp"])
    got = [r["comm_calls/reduce_scatter_fsdp"] for r in records]
    assert got == [units, units], f"reduce-scatters per step on rank 0: {got}, not {units}"


@pytest.mark.parametrize(
    "world, overrides, count",
    [
        # dp2, m = 4 per rank: 4 layers + the chunk root, each reduce-scatters every microbatch
        (2, [], 5 * 4),
        # pp2 zb-h1, rank 0 holds 2 layers + its root (the embedding alone): B reduce-scatters
        # what it completed (norms, the embedding), each W the layer's linear weights
        pytest.param(4, ["parallel.pp=2", "parallel.pipeline_schedule=zb-h1"], (2 * 2 + 1) * 4,
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_zero3_per_microbatch_reduces_every_microbatch(world, overrides, count):
    """parallel.zero3_grad_reduce=microbatch: every microbatch's backward reduce-scatters each
    unit (FSDP2's default with accumulation), not only the step's last (the parity of these
    sums with the one-rank run: test_zero3_loss_parity's *_per_microbatch layouts)."""
    from tests.parallel.parity import train_records

    args = [*LLAMA, Z3, PER_MB, *overrides, "train.steps=2", "train.micro_batch_size=1"]
    records = train_records(world, args, ["comm_calls/reduce_scatter_fsdp"])
    got = [r["comm_calls/reduce_scatter_fsdp"] for r in records]
    assert got == [count, count], f"reduce-scatters per step on rank 0: {got}, not {count}"


def test_zero3_grad_reduce_value_is_checked():
    from megatron_lite.config import load_config
    from megatron_lite.validation import validate

    cfg = load_config(None, [*TINY, "data.mock=true", Z3, "parallel.zero3_grad_reduce=layer"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert "parallel.zero3_grad_reduce" in str(e.value) and "microbatch" in str(e.value)
