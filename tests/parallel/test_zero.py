"""ZeRO-1/2 (the distributed optimizer), hybrid sharding and optimizer offload give the losses
of a single rank (fp32, 6 steps), on the layouts that can break them: several buckets, DP
alone, TP+SP replicas, pipeline chunks with tied embeddings, CP, experts; ZeRO-2 with two
microbatches per step (its per-microbatch reduce-scatters) on dp2, pp2 vpp2 and hybrid."""

import pytest

from tests.parallel.parity import (
    SHORT,
    assert_parity,
    max_rel_diff,
    reference_losses,
    train_losses,
    train_records,
)

SMALL_BUCKETS = ["parallel.ddp_bucket_size=20000"]  # several buckets per chunk
LLAMA = ("model.arch=llama",)
MOE = ("model.arch=llama", "model.num_experts=4", "model.moe_router_topk=2")
LAYOUTS = {
    "zero1_dp4": (4, LLAMA, ["parallel.zero_stage=1"]),
    "zero2_dp2": (2, LLAMA, ["parallel.zero_stage=2"]),
    "zero2_tp2_sp_dp2": (4, LLAMA, ["parallel.zero_stage=2", "parallel.tp=2",
                                    "parallel.sequence_parallel=true"]),
    "zero2_pp2_vpp2_dp2": (4, LLAMA, ["parallel.zero_stage=2", "parallel.pp=2", "parallel.vpp=2"]),
    "zero2_cp2_dp2": (4, LLAMA, ["parallel.zero_stage=2", "parallel.cp=2"]),
    "zero1_ep2_dp2": (2, MOE, ["parallel.zero_stage=1", "parallel.ep=2"]),
    "zero2_dp4_shard2": (4, LLAMA, ["parallel.zero_stage=2", "parallel.dp_shard=2",
                                    "train.micro_batch_size=1"]),  # 2 microbatches
    "zero1_offload_dp2": (2, LLAMA, ["parallel.zero_stage=1", "train.optimizer_offload=cpu"]),
}  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_loss_parity(layout, tmp_path):
    world, model, overrides = LAYOUTS[layout]
    model = (*model, *SHORT)
    ref = reference_losses(model)
    got = train_losses(world, [*model, *SMALL_BUCKETS, *overrides], str(tmp_path))
    assert_parity(got, ref, layout)


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_bf16_stages_track_the_bf16_single_rank(tmp_path):
    """bf16 weights with fp32 masters: every stage follows the bf16 single-rank run more
    closely than bf16 follows fp32."""
    fp32 = reference_losses((*LLAMA, *SHORT))
    bf16 = reference_losses((*LLAMA, *SHORT, "train.precision=bf16"))
    band = max_rel_diff(bf16, fp32)
    for stage in (0, 1, 2):
        over = [*LLAMA, *SHORT, "train.precision=bf16", f"parallel.zero_stage={stage}"]
        got = train_losses(2, over, str(tmp_path / str(stage)))
        diff = max_rel_diff(got, bf16)
        print(f"BF16 zero{stage} dp2 vs bf16 one rank: {diff:.2e} (bf16 vs fp32: {band:.2e})")
        assert diff < band, f"zero{stage}: {diff:.2e} not tighter than bf16 vs fp32 {band:.2e}"


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_resume_across_stages_and_dp_sizes(tmp_path):
    """Save on ZeRO-1 dp2, resume on ZeRO-2 dp4, then back on ZeRO-1 dp2: every loss equals the
    straight single-rank run's (the checkpoint holds logical per-parameter tensors)."""
    ref = reference_losses(LLAMA)
    first, second, third = (str(tmp_path / d) for d in ("a", "b", "c"))
    save = ["train.save_interval=5", *SMALL_BUCKETS]
    stop_at_10 = ["train.steps=10", "train.lr_decay_steps=20"]  # the 20-step LR schedule
    a = train_losses(2, [*LLAMA, *save, "parallel.zero_stage=1", *stop_at_10], first)
    resume_b = f"train.resume={first}/checkpoints/step_10"
    b = train_losses(4, [*LLAMA, *save, "parallel.zero_stage=2", resume_b], second)
    resume_c = f"train.resume={second}/checkpoints/step_15"
    c = train_losses(2, [*LLAMA, *save, "parallel.zero_stage=1", resume_c], third)
    got = a + b[:5] + c
    diff = max_rel_diff(got, ref)
    print(f"ZERO resume 1/dp2 -> 2/dp4 -> 1/dp2: max rel diff {diff:.2e}")
    assert diff < 1e-5, f"resume across stages: {diff:.2e}\n{got}\n{ref}"


@pytest.mark.slow  # 9 s (the suite's budget)
def test_bf16_gradient_reduction_halves_the_bytes_and_tracks_fp32(tmp_path):
    """parallel.grad_reduce_dtype=bf16 with fp32 weights: every stage sends its gradients in
    bf16 (half the bytes of an fp32 reduction, counted in the run) and follows the fp32 single
    rank more closely than a bf16-weights run does (only the reduction is rounded)."""
    fp32 = reference_losses((*LLAMA, *SHORT))  # shared with test_bf16_stages_track_...
    band = max_rel_diff(reference_losses((*LLAMA, *SHORT, "train.precision=bf16")), fp32)
    keys = ("loss", "comm_bytes/all_reduce_dp", "comm_bytes/reduce_scatter_dp",
            "comm_bytes/reduce_scatter_fsdp")  # fmt: skip
    for stage in (0, 1, 2, 3):
        over = [*LLAMA, *SHORT, f"parallel.zero_stage={stage}",
                "parallel.ddp_bucket_size=100000000"]  # fmt: skip
        records = train_records(2, [*over, "parallel.grad_reduce_dtype=bf16"], keys)
        got = [r["loss"] for r in records]
        diff = max_rel_diff(got, fp32)
        print(f"BF16 REDUCE zero{stage} dp2 vs fp32 one rank: {diff:.2e} (bf16 weights {band:.2e})")
        assert diff < band, f"zero{stage}: {diff:.2e} not tighter than bf16 weights {band:.2e}"
        fp32_step = train_records(2, [*over, "train.steps=1"], keys)[0]
        sent = {k: v for k, v in records[0].items() if k != "loss"}
        assert sent and sent.keys() == fp32_step.keys() - {"loss"}, (sent, fp32_step)
        for k, v in sent.items():
            assert 2 * v == fp32_step[k], f"zero{stage} {k}: bf16 {v} vs fp32 {fp32_step[k]}"
        print(f"BF16 REDUCE zero{stage} bytes per step: {sent} (fp32: {fp32_step})")
